"""The device check: the messenger's device mechanisms proven outside SGLang, in minutes.

A GPU is at hand for this project only now and then, and the GPU machine has no SGLang
(`scripts/gpu-check` runs this package there with only PyTorch, CuPy and cuda-bindings).
So the check proves our mechanisms, not the SGLang integration:

- `streaming`: a toy model of L attention-like blocks (each writes its layer's KV, then
  runs an o_proj) with the messenger's own LayerCounter and Streamer; on CUDA captured in a
  CUDA graph and replayed. Each layer's KV is written to a second process through the
  same-host backend (cudaipc on CUDA, shmem on CPU) once the word passes the layer; the
  receiver's bytes must equal the sender's, and layer 0 must be posted before the forward
  ended. Its negative control runs eagerly with a counter bumped in Python at hook time
  (how the counter worked before): on a GPU it posts before the KV exists.
- `bandwidth`: the same-host backend's write rate against a plain copy in the same process.
- `fdpass`: an allocation exported at an offset and imported by another process over
  SCM_RIGHTS (cuMem on CUDA, a memfd on CPU).

`python -m sglang_disagg.devcheck --device cpu` is the CPU twin that `make test` runs: the
same harness up to the device calls.
"""
