"""The data side of the OLMo 3 recipe."""
