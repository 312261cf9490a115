"""Evaluation: measurements of the runtime and of the servers (:mod:`.serving_client`: load a running server)."""
