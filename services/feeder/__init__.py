"""prompt-feeder: reads a prompt set once, normalizes it, and queues every new prompt exactly once."""
