"""Two workarounds for Paddle 3.3.1's gloo process groups (CPU), so that fleet's hybrid
layouts with more than two processes start and train (``docs/upstream/paddle-gloo-subgroups.md``).

**Subgroups rendezvous on a store of their own** (``isolate_gloo_groups``).
``paddle.distributed.new_group`` with the gloo backend calls
``ProcessGroupGloo::CreateProcessGroupGloo(store, rank, size, gid)``, which connects the group's
processes twice on the launch's global TCP store: once for its ``GlooCommContext`` under the
key prefix ``<gid>/`` (the context every collective uses), then again in the
``ProcessGroupGloo`` constructor (``_context->connectFullMesh(*_store, device)``) with no
prefix at all. gloo's full-mesh rendezvous stores each member's listening addresses under the
key ``str(rank in the group)``, so that second rendezvous reads whatever group last wrote
``"0"``, ``"1"``, ...: the global group's keys, or those of a group created at the same moment
by other processes (fleet's hybrid topology creates ``[0, 2]`` and ``[1, 3]`` together under
pp2 x mp2). A process then connects to another group's (or a closed) address and
``new_group`` fails with "Connection refused" or a gloo TIMEOUT. The store binding has no
delete and no prefix store, so no creation order avoids the stale keys. Here every gloo
``new_group`` gets a TCP store that belongs to that group alone: its lowest rank serves it on
a free port of its own host and publishes ``host:port`` in the global store under
``gptc/gloo/<gid>``; the other members connect to it. Both rendezvous of the group then see
only the group's own keys. ``CreateGlooCommContext`` also records the store it is given as the
comm-context manager's store; the binding exposes no manager instance to set it back, and the
group stores stay alive, so that record points at a live store.

**Point-to-point on two-process groups** (``pair_groups``). A gloo process group tags every
operation with its own running count (``next_tag()``) and a send meets only the receive with
the same tag. Where the members of a group of more than two exchange with different peers
(pipeline stages 0-1, 1-2, 2-3) the counts of two neighbours drift apart and the send and its
receive never meet (gloo TIMEOUT): pp > 2, and so the interleaved schedule (vpp), never ran on
gloo. Routed through a group of just the two peers, every operation of that group is between
them and the counts agree, as they do for pp2.

The global group (``init_parallel_env``), the collectives and fleet's schedules are Paddle's own.
"""
from __future__ import annotations

import socket

_STORES: list = []  # the per-group stores live as long as the process (their groups do too)
_KEY = "gptc/gloo/{gid}"
_installed = False


def _free_port(host: str) -> int:
    """A TCP port nobody listens on at ``host`` (bound once and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _group_store(default_store, rank: int, world_size: int, gid: int):
    """A TCP store of the group ``gid`` (this process is its rank ``rank`` of ``world_size``)."""
    from paddle.base import core
    from paddle.distributed.collective import _get_global_env

    key = _KEY.format(gid=gid)
    if rank == 0:
        host = _get_global_env().current_endpoint.rsplit(":", 1)[0]
        port = _free_port(host)
        default_store.set(key, f"{host}:{port}".encode())
        # Blocks until the group's world_size members have connected.
        store = core.TCPStore(host, port, True, world_size)
    else:
        default_store.wait(key)
        host, port = bytes(default_store.get(key)).decode().rsplit(":", 1)
        store = core.TCPStore(host, int(port), False, world_size)
    _STORES.append(store)
    return store


def isolate_gloo_groups() -> None:
    """Make each later gloo ``paddle.distributed.new_group`` rendezvous on its own TCP store
    (module docstring). Idempotent; call before ``fleet.init`` or the first ``new_group``."""
    global _installed
    if _installed:
        return
    import paddle.distributed.collective as collective

    impl = collective._new_process_group_impl

    def new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, **kwargs):
        if backend != "gloo" or group_id == 0:
            return impl(backend, store, rank, world_size, group_name, pg_options, group_id=group_id, **kwargs)
        own = _group_store(store, rank, world_size, group_id)
        return impl(backend, own, rank, world_size, group_name, pg_options, group_id=group_id, **kwargs)

    collective._new_process_group_impl = new_process_group_impl
    _installed = True


# ----------------------------------------------------------------- point-to-point on pairs
_PAIRS: dict = {}  # frozenset({rank a, rank b}) -> the two-process group
_routed = False


def pair_groups(rings: list[list[int]]) -> None:
    """Create a two-process group for each pair of neighbours of each ring in ``rings`` (the
    pipeline's stage lists, last to first included) and route point-to-point operations
    between them on any larger group through it. Every process calls it with the same
    ``rings`` (group ids are handed out in creation order)."""
    import importlib

    import paddle.distributed as dist

    # The modules (the package's ``send`` / ``recv`` names are the functions).
    stream_send = importlib.import_module("paddle.distributed.communication.stream.send")
    stream_recv = importlib.import_module("paddle.distributed.communication.stream.recv")

    for ring in rings:
        for i, a in enumerate(ring):
            key = frozenset((a, ring[(i + 1) % len(ring)]))
            if len(key) == 2 and key not in _PAIRS:
                _PAIRS[key] = dist.new_group(sorted(key))
    global _routed
    if not _routed:
        stream_send._send_in_dygraph = _on_pair(stream_send._send_in_dygraph)
        stream_recv._recv_in_dygraph = _on_pair(stream_recv._recv_in_dygraph)
        _routed = True


def _on_pair(p2p):
    """``p2p(tensor, peer_rank_in_group, group, ...)`` on the pair group of this process and the
    peer when ``group`` has more than two processes and that pair group exists."""
    import paddle.distributed as dist

    def routed(tensor, peer_in_group, group, *args):
        if group is not None and group.nranks > 2:
            peer = group.ranks[peer_in_group]
            pair = _PAIRS.get(frozenset((dist.get_rank(), peer)))
            if pair is not None:
                return p2p(tensor, pair.ranks.index(peer), pair, *args)
        return p2p(tensor, peer_in_group, group, *args)

    return routed
