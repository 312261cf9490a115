"""Evaluation and calibration of DiffKV configurations against the uncompressed cache."""
