"""Transcriptions of peer frameworks' loss functions, for equality tests only (never imported by
the package). Each module names the repository, path and commit it transcribes."""
