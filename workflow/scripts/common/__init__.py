"""Helpers shared by the pipeline's stage scripts: atomic writes, profile
resolution, the record schema, run facts (versions, commit) and the stage entry
point that runs a script natively or inside the configured container."""
