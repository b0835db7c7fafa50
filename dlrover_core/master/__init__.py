"""JobMaster: scheduler, executor, failover, job context."""
