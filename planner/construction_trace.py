"""The construction of a training run's model, as `alloc_trace.allocation_events` writes it: built on the
device (or the meta device), cast, sharded by the wrapper (FSDP2's shards, FSDP1's flat parameters), DDP's
broadcast and first gradient bucket, and the sizes of the optimizer states made lazily in the first step.
See alloc_trace's module docstring (Construction) for what it follows."""

from __future__ import annotations

from dataclasses import fields
from math import prod

from .config import TrainConfig
from .model import ModelSpec, unit_sizes
from .state_layout import _opt_state, zero1_owned_shapes
from .trace_events import _broadcast_coalesced, _Events, _fsdp2_construct


def _construction_events(E: _Events, train: TrainConfig, st, world: int, shard: int, lay, init: str) -> tuple:
    """Construction: the model built on the device (or the meta device), the wrapper's sharding (FSDP2's
    shards, FSDP1's flat parameters), DDP's broadcast and first bucket, and the optimizer state's sizes (made
    lazily in the first step). Returns (DDP's gradient buckets, each optimizer state's bytes, the elements of
    the parameters or shards this rank owns)."""
    m = train.model
    prec = train.prec
    family = st.family
    L = m.layers
    t = train.tp
    pb, gb = prec.param_bytes, prec.grad_bytes
    root_shapes, block_shapes, _, _, _ = unit_sizes(m)
    n_embed = 1 + (m.position == "learned")
    embed_shapes, head_shapes = root_shapes[:n_embed], root_shapes[n_embed:]
    sharding = shard > 1 and st.shards_params
    fsdp = st.fsdp
    units = [list(embed_shapes)] + [list(block_shapes)] * L + [list(head_shapes)]
    meta = init == "meta" and fsdp
    # Pure 16-bit training, built on the device: the model is made in fp32 (the factory's and transformers'
    # default dtype) and then cast (`model.to(torch.bfloat16)`, as the probes do before wrapping:
    # validate/wrap.py, probe.py). `nn.Module._apply` casts children first, each parameter into a new
    # tensor before the fp32 one goes (`param.data = fn(param)`), so its fp32 segments stay reserved.
    built = 4 if pb == 2 and not prec.mixed and not meta else pb
    full = _built_parameters(E, m, units, n_embed, t, meta, built, pb)
    if st.fsdp2:
        param_shards = _fsdp2_construct(E, units, full, shard if sharding else 1, pb, meta)
    elif st.fsdp1:
        _fsdp1_flatten(E, st, units, full, shard, pb, meta)
        param_shards = [lay.shard_root] + [lay.shard_block] * L
    else:
        param_shards = [prod(s) for u in units for s in u]
    buckets: list = []
    if st.ddp_reducer and world > 1:
        # DistributedDataParallel.__init__: `_sync_module_states` broadcasts the parameters from rank 0
        # through `_broadcast_coalesced` (buckets of at least 250 MiB, two in flight), then the Reducer's
        # first-iteration bucket holds every gradient (one bucket: limits [sys.maxsize]); rebuilt in
        # gradient-ready order in the second forward (`_rebuild_buckets`: old buckets freed first).
        _broadcast_coalesced(E, [prod(x) * pb for u in units for x in u])
        buckets = [E.a(lay.total * gb)]
    # optimizer: states owned by this rank (ZeRO-1: its partition; FSDP: the shards)
    if st.zero_optimizer and shard > 1:
        owned = [prod(s) for s in zero1_owned_shapes(m, shard)]
    else:
        owned = list(param_shards)
    # The walk's optimizer-state bytes (memory._opt_state: AdamW 2 states, SGD-momentum 1, 8-bit AdamW
    # uint8 states plus block statistics, Adafactor factored rows/columns), two tensors per parameter
    # (one for SGD-momentum), in proportion to its elements.
    st_elems, st_extra = _opt_state(m, train.optimizer, family, shard)
    st_total = st_elems * pb + int(st_extra)
    per_param = 1 if train.optimizer == "sgd-momentum" else 2
    if (train.cpu_offload == "params" and fsdp) or not owned or not st_total:
        st_total, owned = 0, []
    owned_sum = sum(owned) or 1
    state_sizes = [st_total * s // owned_sum // per_param for s in owned for _ in range(per_param)]
    return buckets, state_sizes, owned


def _tied_head_transient(E: _Events, m, pb: int) -> None:
    """A transformers model with tied embeddings, built on the device: its `*ForCausalLM.__init__` makes the
    LM head as an `nn.Linear` of its own (`self.lm_head = nn.Linear(hidden, vocab)`: a vocab x hidden weight,
    initialised) after the decoder, and `post_init` -> `tie_weights` points it at the embedding's weight,
    dropping its own: one embedding-sized allocation and free at the end of construction, whose segment the
    allocator keeps (seen in the CPU probes' recorded traces: transformers 5.24 Qwen2 at vocabulary 32,768,
    a 64 MiB alloc and free after the last block's parameters). The reference decoder (`hf_model_type` "")
    makes no head when tied."""
    if m.tie_embeddings and m.hf_model_type:
        E.f(E.a(m.vocab * m.hidden * pb))


def _cast_built(E: _Events, units_of: list, keys_of: list, built: int, pb: int) -> list:
    """`model.to(16-bit)` over the units' fp32 parameters (in module order): each one's 16-bit copy,
    the fp32 one freed."""
    if built == pb:
        return keys_of
    out = []
    for u, keys in zip(units_of, keys_of):
        out.append([])
        for s, k in zip(u, keys):
            out[-1].append(E.a(prod(s) * pb))
            E.f(k)
    return out


def _built_parameters(E: _Events, m, units: list, n_embed: int, t: int, meta: bool, built: int,
                      pb: int) -> list:
    """The parameters as built on the device (None each on the meta device): one event key per parameter
    of each unit (the embedding, the blocks, the head), in this rank's tensor-parallel shapes."""
    L = m.layers
    if t > 1 and not meta:
        # Tensor parallelism on a model built on the device (the probes): the whole model first, then
        # `parallelize_module` (`distribute_tensor`: each sharded parameter's local chunk scattered into
        # a new tensor, the whole one dropped; replicated ones kept as they are)
        whole_spec = ModelSpec(**{f.name: getattr(m, f.name) for f in fields(ModelSpec)})
        w_root, w_block, _, _, _ = unit_sizes(whole_spec)
        w_units = [list(w_root[:n_embed])] + [list(w_block)] * L + [list(w_root[n_embed:])]
        whole = [[E.a(prod(s) * built) for s in u] for u in w_units]
        _tied_head_transient(E, m, built)
        whole = _cast_built(E, w_units, whole, built, pb)
        full = []
        for u, wu, keys in zip(units, w_units, whole):
            full.append([])
            for s, ws, k in zip(u, wu, keys):
                if tuple(s) == tuple(ws):
                    full[-1].append(k)
                else:
                    full[-1].append(E.a(prod(s) * pb))
                    E.f(k)
    else:
        full = [[None if meta else E.a(prod(s) * built) for s in u] for u in units]
        if not meta:
            _tied_head_transient(E, m, built)
            full = _cast_built(E, units, full, built, pb)
    return full


def _fsdp1_flatten(E: _Events, st, units: list, full: list, shard: int, pb: int, meta: bool) -> None:
    """FSDP1's construction: each unit's parameters flattened into its FlatParameter, a padded chunk kept."""
    L = len(units) - 2
    # FlatParameter per block (ModuleWrapPolicy), the root's last; flatten, then keep a padded chunk
    order = list(range(1, L + 1)) + [0]
    for u in order:
        keys = full[u] + (full[L + 1] if u == 0 else [])
        elems = sum(prod(s) for s in units[u]) + (sum(prod(s) for s in units[L + 1]) if u == 0 else 0)
        if meta:  # FSDP1 materializes a meta unit before flattening it (_init_utils.py
            # `_materialize_meta_module`: to_empty + reset_parameters), one unit at a time
            keys = [E.a(prod(s) * pb) for s in units[u] + (units[L + 1] if u == 0 else [])]
        # `FlatParamHandle`: flatten_tensors_into_flat_param, then shard() keeps a chunk and frees the flat
        # tensor; the originals go after, once the module holds views of the flat parameter (the order the
        # recorded CPU traces show: flat, shard, flat freed, the originals freed)
        flat = E.a(elems * pb)
        if st.shards_params or st.shards_optimizer:
            E.a(-(-elems // shard) * pb)
            E.f(flat)
        E.f(*keys)
