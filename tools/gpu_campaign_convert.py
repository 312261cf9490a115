"""Convert Gemma 3 270M on the device with the tokenizer carried from the CPU machine (tools/gpu_campaign.sh call 6).

The device's transformers (5.17) rebuilds Gemma 3's tokenizer from the GGUF wrong, and the conversion refuses it
(``check_gguf_tokenizer``). This converts the weights with the device's transformers and takes the tokenizer from
TOKENIZER_DIR (rebuilt and checked by transformers 5.25 on the CPU machine); the same check then runs on it
against the GGUF, so a carried tokenizer that reads the file otherwise is refused too.

    python3 tools/gpu_campaign_convert.py TOKENIZER_DIR
"""
import sys

from transformers import AutoTokenizer

from trtllm_diffkv.model.loader import packaged_model_path

carried = sys.argv[1]
rebuild = AutoTokenizer.from_pretrained


def from_carried(path, *args, gguf_file=None, **kwargs):
    return rebuild(carried if gguf_file else path, *args, **kwargs)


AutoTokenizer.from_pretrained = from_carried
print(packaged_model_path("gemma3-270m"))
