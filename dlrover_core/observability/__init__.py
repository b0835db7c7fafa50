"""Job observability outside the job directory's own files (TensorBoard)."""
