"""A run's lifecycle: prepare (resolve, check, derive, freeze), launch the workers, the run directory."""
