"""The training loop and what it drives: schedule, stability guard, metrics, hooks."""
