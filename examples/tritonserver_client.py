"""Query the DiffKV model in Triton Inference Server with ``tritonclient``: gRPC streaming and HTTP generate.

Write and serve the repository first (default model; HTTP 8000, gRPC 8001, metrics 8002)::

    trtllm-diffkv triton-repo --out triton_repo --serve

then ``python3 examples/tritonserver_client.py [--http 127.0.0.1:8000] [--grpc 127.0.0.1:8001]``. The
tensors are TensorRT-LLM's (``text_input``, ``max_tokens``, ``stream``, ... -> ``text_output``), as
``[batch, 1]`` arrays.
"""
import argparse
import queue

import httpx
import numpy as np
import tritonclient.grpc as grpcclient

MODEL = "trtllm_diffkv"


def tensor(name: str, value, datatype: str, dtype) -> grpcclient.InferInput:
    array = np.array([[value]], dtype=dtype)
    result = grpcclient.InferInput(name, list(array.shape), datatype)
    result.set_data_from_numpy(array)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    args = parser.parse_args()
    print(f"Triton at http://{args.http} (HTTP) and {args.grpc} (gRPC), model {MODEL}", flush=True)
    answer = httpx.post(f"http://{args.http}/v2/models/{MODEL}/generate", timeout=300,
                        json={"text_input": "The capital of France is", "max_tokens": 16}).json()
    print("HTTP generate:", repr(answer["text_output"]), answer["finish_reason"], flush=True)

    responses = queue.Queue()
    with grpcclient.InferenceServerClient(args.grpc) as client:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = [tensor("text_input", "The capital of France is".encode(), "BYTES", object),
                  tensor("max_tokens", 32, "INT32", np.int32), tensor("stream", True, "BOOL", bool),
                  tensor("temperature", 0.0, "FP32", np.float32)]
        client.async_stream_infer(MODEL, inputs, request_id="1", enable_empty_final_response=True)
        print("gRPC stream: ", end="", flush=True)
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise SystemExit(f"error: {error}")
            response = result.get_response()
            if response.outputs:
                print(result.as_numpy("text_output")[0, 0].decode(), end="", flush=True)
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    print(flush=True)


if __name__ == "__main__":
    main()
