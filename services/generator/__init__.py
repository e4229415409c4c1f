"""generator: one process per GPU turning PromptTasks into completion shards in S3 (write-then-ack)."""
