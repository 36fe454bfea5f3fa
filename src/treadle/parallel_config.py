"""Where the model runs: its tensor x pipeline-parallel ranks, the data-parallel engine cores,
the hosts they span, and the checks that reject an impossible layout; with the pipeline's split
of the decoder layers among its stages. One area of `treadle.config.EngineConfig`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from treadle import envs
from treadle.ipc import cluster_auth

EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks that each hold a shard of the model (one process each)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages: each holds a contiguous share of the decoder layers (vLLM's split; TREADLE_PP_LAYER_PARTITION="10,10,10" chooses it) and tensor_parallel_size ranks of its own."""
    data_parallel_size: int = 1
    """Engine cores, each with a whole copy of the model, behind the same front end."""
    data_parallel_size_local: int | None = None
    """Engine cores on this host; default: all of them."""
    data_parallel_start_rank: int = 0
    """DP rank of this host's first engine core (set on the other hosts)."""
    data_parallel_address: str | None = None
    """Address of the host that runs the front end (DP rank 0); engines on other hosts connect to it."""
    data_parallel_rpc_port: int | None = None
    """Port of the front end's handshake socket, which engines on other hosts connect to."""
    cpu_threads: int | None = None
    """CPU threads each engine core (or TP worker) runs the model with; default: the cores this process may use (affinity, cgroup quota) divided among its engine cores and TP workers (TREADLE_CPU_THREADS sets it too)."""
    cluster_secret_file: str | None = None
    """A file holding the cluster secret (at least 16 bytes, the same file on every host): every tcp socket between treadle's processes then speaks ZMQ CURVE with keys derived from it, and a peer without it is refused and logged (TREADLE_CLUSTER_SECRET holds the secret itself instead). Required when engines on other hosts reach the front end over a non-loopback address."""
    insecure_cluster: bool = False
    """Accept sockets that face other hosts without a cluster secret: anyone who reaches the ports can talk to the engines."""
    nnodes: int = 1
    """Hosts that one model's tensor/pipeline-parallel ranks span without Ray (vLLM's --nnodes): node r runs ranks r*k .. (r+1)*k-1 of the tp x pp ranks, k = tp x pp / nnodes. Node 0 runs the server, the engine core and its ranks; every other node runs `treadle serve M ... --node-rank R --headless` and starts only its ranks' workers."""
    node_rank: int = 0
    """This host's place among --nnodes hosts (0: the one that serves)."""
    master_addr: str = "127.0.0.1"
    """Node 0's address, where the engine core's rendezvous store listens (--nnodes > 1): the other nodes' workers find the engine core there. A node's own address is TREADLE_HOST_IP, else the interface that routes to this one."""
    master_port: int | None = None
    """Port of the rendezvous store on --master-addr (required with --nnodes > 1)."""
    distributed_executor_backend: str = "mp"
    """What starts and watches the tensor/pipeline-parallel workers: mp (a process per rank on this host) or ray (a Ray actor per rank, placed by a placement group on the Ray cluster at RAY_ADDRESS, else the one running on this host, else a local one started for this engine core; pip install 'treadle[ray]'). Ray places the workers; the steps still go through the shared-memory queue (TCP to other nodes)."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_engine_count(self) -> int:
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local

    @property
    def ranks_per_node(self) -> int:
        """The tp x pp ranks that run on each of the --nnodes hosts."""
        return self.world_size // max(1, self.nnodes)

    def node_ranks(self, node: int) -> range:
        """The ranks that node `node` runs (node-major: node r holds [r*k, (r+1)*k))."""
        k = self.ranks_per_node
        return range(node * k, (node + 1) * k)

    def model_threads(self) -> int:
        """Threads for one engine core or TP worker of this host (see `cpu_threads`)."""
        chosen = self.cpu_threads or envs.cpu_threads()
        if chosen:
            return chosen
        return max(1, envs.usable_cpus() // (self.local_engine_count * self.ranks_per_node))

    def threads_pinned(self) -> bool:
        """The user chose the thread count; else it follows free cores (worker/cpu_share.py)."""
        return bool(self.cpu_threads or envs.cpu_threads())

    @property
    def multi_node(self) -> bool:
        """Some engine cores run on another host: every engine-facing socket is tcp."""
        return self.local_engine_count < self.data_parallel_size

    def check(self) -> None:
        """Reject an impossible DP layout with a message that says what to change."""
        dp, local, start = (
            self.data_parallel_size,
            self.local_engine_count,
            self.data_parallel_start_rank,
        )
        if dp < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, not {dp}")
        for flag, size in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
        ):
            if size < 1:
                raise ValueError(f"{flag} must be at least 1, not {size}")
        pp_layer_partition(None, self.pipeline_parallel_size)  # TREADLE_PP_LAYER_PARTITION's form
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, not {self.cpu_threads}")
        if local < 0 or start < 0 or start + local > dp:
            raise ValueError(
                f"--data-parallel-start-rank {start} + --data-parallel-size-local {local} "
                f"exceed --data-parallel-size {dp}"
            )
        if self.multi_node and self.data_parallel_rpc_port is None:
            raise ValueError(
                "engines on other hosts need --data-parallel-rpc-port (and "
                "--data-parallel-address) to find the front end"
            )
        envs.host_ip()  # a bad TREADLE_HOST_IP is a start-up error, not a socket's
        self.check_cluster_secret()
        self.check_executor_backend()
        self.check_nodes()

    def check_nodes(self) -> None:
        """--nnodes/--node-rank/--master-addr/--master-port: a layout every node can follow."""
        n, r = self.nnodes, self.node_rank
        if n < 1:
            raise ValueError(f"--nnodes must be at least 1, not {n}")
        if not 0 <= r < n:
            raise ValueError(f"--node-rank {r} must be between 0 and --nnodes - 1 ({n - 1})")
        if n == 1:
            return
        if self.world_size % n:
            raise ValueError(
                f"--nnodes {n} does not divide the {self.world_size} ranks of -tp "
                f"{self.tensor_parallel_size} x -pp {self.pipeline_parallel_size}: every node "
                "runs the same number of ranks"
            )
        if self.data_parallel_size > 1:
            raise ValueError(
                "--nnodes spreads one engine core's ranks over hosts; for -dp over hosts use "
                "--headless engines with --data-parallel-address instead"
            )
        if self.distributed_executor_backend != "mp":
            raise ValueError(
                "--nnodes is the mp backend's way across hosts; Ray places the ranks on its "
                "nodes itself (drop --nnodes with --distributed-executor-backend ray)"
            )
        if self.master_port is None or not 0 < self.master_port < 65536:
            raise ValueError(
                "--nnodes > 1 needs --master-port (and --master-addr): where node 0's "
                "rendezvous store listens for the other nodes"
            )
        if (
            not cluster_auth.is_loopback(self.master_addr)
            and not (self.cluster_secret_file or cluster_auth.configured())
            and not self.insecure_cluster
        ):
            raise ValueError(
                f"the nodes meet at {self.master_addr}, and nothing keys the sockets between "
                "them: give every node the same --cluster-secret-file (or "
                "TREADLE_CLUSTER_SECRET), or --insecure-cluster to accept open sockets"
            )

    def check_executor_backend(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"--distributed-executor-backend {backend!r}: choose one of "
                f"{', '.join(EXECUTOR_BACKENDS)}"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "--distributed-executor-backend ray needs Ray, which is not installed: "
                "pip install 'treadle[ray]'"
            )

    def check_cluster_secret(self) -> None:
        """Sockets that face another host need the cluster secret (or --insecure-cluster)."""
        if self.cluster_secret_file is not None:
            cluster_auth.read_secret_file(self.cluster_secret_file)
        else:
            cluster_auth.cluster_keys()  # a secret in the environment is checked too
        address = self.data_parallel_address or "127.0.0.1"
        if (
            self.multi_node
            and not cluster_auth.is_loopback(address)
            and not (self.cluster_secret_file or cluster_auth.configured())
            and not self.insecure_cluster
        ):
            raise ValueError(
                f"engines on other hosts reach this one at {address}, and nothing keys those "
                "sockets: give every host the same --cluster-secret-file (or "
                "TREADLE_CLUSTER_SECRET), or --insecure-cluster to accept open sockets"
            )


def pp_layer_partition(num_layers: int | None, pp_size: int) -> list[int]:
    """The decoder layers of each pipeline stage, as vLLM's `get_pp_indices`: equal shares,
    the remainder one each to the stages before the last (the last also runs the final norm,
    the LM head and sampling), or TREADLE_PP_LAYER_PARTITION ("10,10,10": one count per stage,
    each at least 1, summing to the layer count). `num_layers` None checks only the
    variable's form (before the model's header is read) and returns []. Raises `ValueError`
    with one line that says what to change."""
    text = envs.pp_layer_partition()
    if text is not None:
        name = f"TREADLE_PP_LAYER_PARTITION={text!r}"
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            raise ValueError(f"{name} is not a comma-separated list of layer counts") from None
        if len(parts) != pp_size:
            raise ValueError(
                f"{name} has {len(parts)} stages, but --pipeline-parallel-size is {pp_size}"
            )
        if min(parts) < 1:
            raise ValueError(f"{name}: every stage needs at least 1 layer")
        if num_layers is not None and sum(parts) != num_layers:
            raise ValueError(f"{name} sums to {sum(parts)}, but the model has {num_layers} layers")
        return parts if num_layers is not None else []
    if num_layers is None:
        return []
    if num_layers < pp_size:
        raise ValueError(
            f"the model has {num_layers} layers: --pipeline-parallel-size {pp_size} would leave "
            "a stage without one"
        )
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers of stage `pp_rank` (`pp_layer_partition`)."""
    parts = pp_layer_partition(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]
