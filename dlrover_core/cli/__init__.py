"""The dlrover command line."""
