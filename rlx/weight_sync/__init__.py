"""Weight transport from the trainer to the rollout engines: HF-named tensors in bounded buckets.

Which path (`rollout.weight_sync`, `auto` picks the first that applies):
  * colocated (engine on the trainer rank's GPU, or same machine on CPU) -> `tensor`: CUDA IPC
    handles (GPU) or shared-memory files (CPU) posted to `/update_weights_from_tensor`;
  * split on GPU -> `distributed` over NCCL: trainer rank 0 broadcasts to the engines;
  * split on CPU -> `distributed` over gloo (or `tensor` over shared memory on one machine);
  * anything else, or a failure to form the group -> `disk` (safetensors shards, as today).
Nothing here knows about the trainer, the engine or HTTP: the integrator wires them.

API (`named` is an iterable of (hf_name, tensor), e.g. `family.export_hf_weights(model)`):

  buckets.py
    iter_buckets(named, bucket_bytes) -> Iterator[list[(name, tensor)]]
    flatten(bucket, out=None) -> (BucketMeta, flat_uint8)       # SGLang's flattened_bucket layout
    unflatten(flat_uint8, meta) -> list[(name, view)]           # views, no copy
    BucketMeta.to_fields() -> {"names", "dtypes", "shapes"};  BucketMeta.from_fields(names, dtypes, shapes)

  distributed.py (split)
    trainer rank 0:  s = WeightSender()
                     s.init(master_address, master_port, world_size, backend="nccl"|"gloo",
                            group_name="weight_update_group", timeout_s=300)   # blocks until all join
                     s.send(named, bucket_bytes, announce=None) -> list[BucketMeta]
                     s.close()
    engine rank r:   r = WeightReceiver()
                     r.init(master_address, master_port, rank, world_size, backend, group_name, timeout_s)
                     r.receive(BucketMeta.from_fields(names, dtypes, shapes)) -> list[(name, view)]
                     r.close()
    Wiring: POST `/init_weights_update_group` {master_address, master_port, rank_offset, world_size,
    group_name, backend} to every engine concurrently with `s.init` (both block until the group
    forms). `announce(meta)` is called before each bucket's broadcast: post
    `/update_weights_from_distributed` {**meta.to_fields(), "group_name", "load_format":
    "flattened_bucket", "flush_cache": last bucket only, "weight_version"} without waiting and
    return a function that waits for the responses; `send` calls it after the broadcast. The
    views `receive` returns are overwritten by the next `receive`: copy them into the parameters.
    All ranks must have the same torch version (the group's store keys are torch's).

  tensor.py (colocated)
    with TensorHandoff(named_list, flat=False) as payload:   # holds the tensors until exit
        POST `/update_weights_from_tensor` {"serialized_named_tensors": [payload] * engine_tp_size,
              "load_format": None, "flush_cache": ..., "weight_version": ...} and wait for the reply
    engine: deserialize(payload) -> list[(name, tensor)]; copy into the parameters, drop them,
    then reply. `flat=True` sends one buffer per bucket (one IPC handle: rlx's engines, whose
    launcher declares `flat_tensor_buckets`; SGLang's take the per-tensor form).
    serialize(named_list) -> str is the bare form (the caller then keeps the tensors alive).

Errors: `distributed.WeightSyncError` (group did not form in time, naming the address; transfer
failed). Speed: `python bench/weight_sync.py --help`.
"""
