"""Calibrate DiffKV thresholds for a model, as the paper does (section 6.1): a wrapper of
``trtllm-diffkv calibrate`` (the logic lives in ``trtllm_diffkv.evaluation.calibration``).

    python examples/calibrate_thresholds.py --output kv.json --data humaneval --first 100 --num-prompts 6
"""
import sys

from trtllm_diffkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["calibrate", *sys.argv[1:]]))
