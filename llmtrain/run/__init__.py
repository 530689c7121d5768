"""A run's lifecycle: prepare (resolve, check, derive, freeze), then launch the workers."""
