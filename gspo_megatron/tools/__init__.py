"""Console scripts: ``gspo-convert-hf``, ``gspo-export-hf``, ``gspo-plan``, ``gspo-routing-report``."""
