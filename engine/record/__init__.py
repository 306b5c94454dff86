"""What a run writes and shows: ``rundir``, ``metrics``, ``tbevents`` (TensorBoard), ``display``, ``truncation``."""
