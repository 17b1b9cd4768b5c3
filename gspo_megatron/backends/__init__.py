"""Model backends: everything that knows a training framework lives under here."""
