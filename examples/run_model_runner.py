"""TensorRT-LLM's examples/run.py, ported to trtllm-diffkv's ModelRunner (same flags, same printout).

    python3 examples/run_model_runner.py --max_output_len 32                 # the default model
    python3 examples/run_model_runner.py --engine_dir ENGINE_OR_HF_DIR --input_text "Hi" "Bye" --streaming

The port: ``from tensorrt_llm.runtime import ModelRunner`` becomes ``from trtllm_diffkv import
ModelRunner``; ``ModelRunner.from_dir`` also takes a Hugging Face folder or a ``.gguf`` (and
``--kv_config``); the rest of the script (tokenize, pad, ``runner.generate(...)``, read
``output_ids`` / ``sequence_lengths``) is unchanged.
"""
import argparse

import torch

from trtllm_diffkv import ModelRunner


def parse_arguments(args=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine_dir", default=None,
                        help="engine dir from `trtllm-diffkv build`, HF folder or .gguf (default: the default model)")
    parser.add_argument("--kv_config", default=None, help="DiffKV preset (default: the engine dir's, else default)")
    parser.add_argument("--input_text", nargs="+", default=["Born in north-east France, Soyer trained as a"])
    parser.add_argument("--input_file", help="one prompt per line (instead of --input_text)")
    parser.add_argument("--max_input_length", type=int, default=923)
    parser.add_argument("--max_output_len", type=int, default=32)
    parser.add_argument("--end_id", type=int, default=None, help="default: the tokenizer's EOS")
    parser.add_argument("--pad_id", type=int, default=None, help="default: the tokenizer's pad id, else end_id")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=1)
    parser.add_argument("--top_p", type=float, default=0.0)
    parser.add_argument("--repetition_penalty", type=float, default=1.0)
    parser.add_argument("--random_seed", type=int, default=0)
    parser.add_argument("--stop_words", nargs="+", default=None, help="strings whose tokens end a sequence")
    parser.add_argument("--no_add_special_tokens", dest="add_special_tokens", action="store_false")
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--streaming_interval", type=int, default=5, help="print every N streamed outputs")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser.parse_args(args)


def parse_input(tokenizer, texts, add_special_tokens, max_input_length) -> list[torch.Tensor]:
    ids = [tokenizer.encode(t, add_special_tokens=add_special_tokens, truncation=True, max_length=max_input_length)
           for t in texts]
    return [torch.tensor(x, dtype=torch.int32) for x in ids]


def print_output(tokenizer, output_ids, input_lengths, sequence_lengths, texts) -> None:
    for batch_idx, text in enumerate(texts):
        print(f'Input [Text {batch_idx}]: "{text}"', flush=True)
        for beam in range(output_ids.size(1)):
            begin, end = input_lengths[batch_idx], int(sequence_lengths[batch_idx][beam])
            output_text = tokenizer.decode(output_ids[batch_idx][beam][begin:end].tolist())
            print(f'Output [Text {batch_idx} Beam {beam}]: "{output_text}"', flush=True)


def main(args) -> None:
    if args.streaming_interval < 1 or args.max_output_len < 1:
        raise SystemExit("error: --streaming_interval and --max_output_len must be >= 1")
    print(f"[run] loading {args.engine_dir or 'the default model'} ...", flush=True)
    runner = ModelRunner.from_dir(args.engine_dir, kv_config=args.kv_config, device=args.device)
    print(f"[run] generating up to {args.max_output_len} tokens per prompt ...", flush=True)
    tokenizer = runner.tokenizer
    if tokenizer is None:
        runner.shutdown()
        raise SystemExit(f"error: {args.engine_dir} has no tokenizer files; this script reads and prints text")
    texts = args.input_text
    if args.input_file:
        with open(args.input_file, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    end_id = args.end_id if args.end_id is not None else tokenizer.eos_token_id
    pad_id = args.pad_id if args.pad_id is not None else (tokenizer.pad_token_id or end_id)
    batch_input_ids = parse_input(tokenizer, texts, args.add_special_tokens, args.max_input_length)
    input_lengths = [x.size(0) for x in batch_input_ids]
    stop_words_list = None
    if args.stop_words:
        words = [tokenizer.encode(w, add_special_tokens=False) for w in args.stop_words]
        stop_words_list = [words] * len(batch_input_ids)
    try:
        if not texts:
            raise SystemExit("error: no input text")
        with torch.no_grad():
            outputs = runner.generate(batch_input_ids, max_new_tokens=args.max_output_len, end_id=end_id,
                                      pad_id=pad_id, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                      repetition_penalty=args.repetition_penalty, random_seed=args.random_seed,
                                      stop_words_list=stop_words_list, streaming=args.streaming,
                                      output_sequence_lengths=True, return_dict=True, num_beams=1)
            if args.streaming:
                for step, out in enumerate(outputs):
                    if step % args.streaming_interval == 0:
                        print_output(tokenizer, out["output_ids"], input_lengths, out["sequence_lengths"], texts)
                outputs = out
            print_output(tokenizer, outputs["output_ids"], input_lengths, outputs["sequence_lengths"], texts)
    except (ValueError, RuntimeError) as exc:  # a bad flag value, or a request that failed: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
    finally:
        runner.shutdown()


if __name__ == "__main__":
    main(parse_arguments())
