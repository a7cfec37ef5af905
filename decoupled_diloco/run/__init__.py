"""The run shell every runtime shares: the run plan, per-learner accounts, records, evaluation, final state."""
