"""The maintenance loops of a relay: the reconciler, its leadership, pruning, the scheduler."""
