"""``fastscale-plan``: predicted all-reduce times, algorithm, fusion plan and scaling for a cluster.

    fastscale-plan resnet50 tencent_p40_100g
    fastscale-plan --crossover

Commands and output are described in ``docs/planner.md`` ("Command line").
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_fastscale.planner.auto import auto_plan, best_chunk_plan
from lightning_fastscale.planner.baseline import PLAIN_DDP_TOLERANCE, crossover_table, format_crossover
from lightning_fastscale.planner.bn_span_cost import bn_channels, bn_span_cost
from lightning_fastscale.planner.cluster import Cluster, ClusterConfigError, available_clusters, load_cluster
from lightning_fastscale.planner.cost_model import (
    ALGORITHMS,
    bandwidth_bound,
    flat_allreduce_detail,
    predict_allreduce,
    wire_bytes_per_element,
)
from lightning_fastscale.planner.fusion import MB, best_uniform_cap, plan_fusion
from lightning_fastscale.planner.profile import build_model, profile_model
from lightning_fastscale.planner.scaling import allreduce_cost, default_gpu_counts, scaling_curve, topology_for
from lightning_fastscale.strategies.options import (
    AUTO_CHUNK_MB_PER_NODE,
    DEFAULT_PIPELINE_CHUNK_MB,
    PLAIN_DDP,
    WIRE_DTYPES,
    CommSetting,
    resolve_chunk_mb,
)


def _pipeline_chunk_mb(text: str) -> float | str:
    """``--pipeline-chunk-mb`` value: ``auto`` or a number of MiB (0: unchunked)."""
    return text if text == "auto" else float(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastscale-plan",
        description="Predict all-reduce time per algorithm, choose the algorithm and gradient "
        "buckets, and predict step time and scaling efficiency on a cluster.",
    )
    parser.add_argument("model", nargs="?", help="model name (torchvision/timm/package factory, bert_base, bert_large); "
                        "default: the cluster's workload.model")
    parser.add_argument("cluster", nargs="?", help=f"cluster YAML path or shipped name ({', '.join(available_clusters())})")
    parser.add_argument("--gpus", type=int, help="GPU count to plan for (default: the cluster's)")
    parser.add_argument("--per-gpu-batch", type=int, help="per-GPU batch (default: the cluster's workload)")
    parser.add_argument("--input-size", type=int, help="image side or sequence length (default: the workload's)")
    parser.add_argument("--wire-dtype", choices=list(WIRE_DTYPES), help="dtype on the wire")
    parser.add_argument("--topk-ratio", type=float, help="top-k ratio for the inter-node stage (hier/torus2d)")
    parser.add_argument("--pipeline-chunk-mb", type=_pipeline_chunk_mb, default=DEFAULT_PIPELINE_CHUNK_MB,
                        help="the strategy's pipeline_chunk_mb: buckets flow through the stages in chunks "
                        f"of this many MiB ('auto', the default: {AUTO_CHUNK_MB_PER_NODE:g} MiB per node; "
                        "0 = unchunked)")
    parser.add_argument("--bn-span", type=int, metavar="N",
                        help="images each BN layer normalises over (model.bn_span): prices the all-reduces "
                        "of the BN statistics when the span is wider than one device")
    parser.add_argument("--fusion", choices=["auto", "two", "single", "ddp25"], default="auto",
                        help="fusion plan used for the scaling curve (default: auto)")
    parser.add_argument("--max-gpus", type=int, default=4096, help="largest GPU count of the scaling curve")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument("--plot", metavar="PNG", help="write scaling efficiency vs GPU count per algorithm")
    parser.add_argument("--list-clusters", action="store_true", help="list the shipped cluster descriptions")
    parser.add_argument("--crossover", action="store_true",
                        help="print where hier, torus2d, a 16-bit wire and top-k beat NCCL's own ring and tree "
                        "(2-64 nodes of 8 GPUs, 10-400 Gbit/s, ResNet-50 and BERT-Large)")
    return parser


def build_report(
    cluster: Cluster, model: str | None = None, gpus: int | None = None, per_gpu_batch: int | None = None,
    input_size: int | None = None, wire_dtype: str | None = None, topk_ratio: float | None = None,
    fusion: str = "auto", max_gpus: int = 4096, pipeline_chunk_mb: float | str | None = DEFAULT_PIPELINE_CHUNK_MB,
    bn_span: int | None = None,
) -> dict:
    """Everything the CLI prints, as a dict (the ``--json`` document)."""
    work = cluster.workload
    model = model or work.model
    batch = per_gpu_batch or work.per_gpu_batch
    size = input_size or work.input_size
    wire = wire_dtype or work.wire_dtype
    topk = topk_ratio if topk_ratio is not None else work.topk_ratio
    ranks_per_node = cluster.ranks_per_node
    gpus = gpus or cluster.nodes * ranks_per_node
    topology = topology_for(gpus, ranks_per_node)
    params = cluster.comm_params()
    profile = profile_model(model, batch, size, cluster.device.sustained_tflops)
    numel = profile.numel
    setting = CommSetting(None, wire, topk, pipeline_chunk_mb)
    allreduce = predict_allreduce(numel, topology, params, setting)
    auto = auto_plan(profile, topology, params, setting, plain_ddp_tolerance=PLAIN_DDP_TOLERANCE)
    cost = allreduce_cost(auto.algorithm, topology, params, PLAIN_DDP if auto.plain_ddp else setting)
    two = plan_fusion(profile.grad_bytes, profile.backward_s, cost, max_buckets=2)
    cap_mb, cap_plan = best_uniform_cap(profile.grad_bytes, profile.backward_s, cost)
    compute = profile.forward_s + profile.backward_total_s
    counts = sorted(set(default_gpu_counts(ranks_per_node, max_gpus)) | {gpus})
    curve = scaling_curve(profile, counts, ranks_per_node, params, setting, fusion)
    split = two.ends[0] if two.num_buckets == 2 else None
    chunk_mb = resolve_chunk_mb(pipeline_chunk_mb, topology.num_nodes)
    best_chunk, _, chunk_finish = best_chunk_plan(profile, topology, params, setting)
    bn = None if bn_span is None else bn_span_cost(bn_span, batch, topology, params, bn_channels(build_model(model)[0]))
    step_s = compute + auto.plan.exposed_s + (bn["sync_s"] if bn else 0.0)
    return {
        "cluster": {
            "name": cluster.name, "nodes": topology.num_nodes, "ranks_per_node": topology.ranks_per_node,
            "gpus": gpus, "device": cluster.device.name, "sustained_tflops": cluster.device.sustained_tflops,
            "params": params.as_dict(), "sources": list(cluster.sources), "assumptions": list(cluster.assumptions),
            "published": list(cluster.published),
        },
        "workload": {
            "model": model, "parameters": numel, "gradient_mb": sum(profile.grad_bytes) / MB,
            "gradients": len(profile.grad_bytes), "per_gpu_batch": batch, "input_size": size,
            "wire_dtype": wire, "topk_ratio": topk,
            "pipeline_chunk_mb": chunk_mb, "pipeline_chunk_setting": pipeline_chunk_mb,
        },
        "allreduce_s": allreduce,
        "flat_baseline": {"what": "plain DDP's flat fp32 all-reduce of the whole gradient",
                          **flat_allreduce_detail(numel, topology, params, "fp32")},
        "bandwidth_bound_s": bandwidth_bound(topology.num_nodes, numel * wire_bytes_per_element(wire), params.beta_inter),
        "chosen_algorithm": auto.algorithm,
        "plain_ddp": auto.plain_ddp,
        "plan_reason": auto.reason,
        "fusion": {
            "auto": auto.plan.as_dict(),
            "ddp_kwargs": auto.ddp_kwargs,
            "two_segment": {**two.as_dict(), "split_after": split,
                            "split_between": None if split is None else [profile.names[split - 1], profile.names[split]]},
            "best_bucket_cap_mb": {"bucket_cap_mb": cap_mb, **cap_plan.as_dict()},
            "per_algorithm_finish_s": {a: p.finish_s for a, p in auto.candidates.items()},
        },
        "pipeline_chunk": {
            "used_mb": chunk_mb, "best_mb": best_chunk,
            "finish_s_by_chunk_mb": {("none" if c is None else f"{c:g}"): t for c, t in chunk_finish.items()},
        },
        "bn_span": bn,
        "step": {
            "compute_s": compute, "forward_s": profile.forward_s, "backward_s": profile.backward_total_s,
            "exposed_comm_s": auto.plan.exposed_s, "bn_sync_s": bn["sync_s"] if bn else 0.0, "step_s": step_s,
            "efficiency": compute / step_s, "images_per_s": gpus * batch / step_s,
        },
        "scaling": {"fusion": fusion, "points": [p.as_dict() for p in curve]},
    }


def _text(report: dict) -> str:
    c, w, f, s = report["cluster"], report["workload"], report["fusion"], report["step"]
    lines = [
        f"cluster {c['name']}: {c['nodes']} nodes x {c['ranks_per_node']} ranks = {c['gpus']} GPUs ({c['device']}, "
        f"{c['sustained_tflops']} TFLOP/s sustained per GPU)",
        f"model {w['model']}: {w['parameters'] / 1e6:.1f}M parameters in {w['gradients']} gradients "
        f"({w['gradient_mb']:.1f} MiB fp32), per-GPU batch {w['per_gpu_batch']}, input {w['input_size']}, "
        f"wire {w['wire_dtype']} between nodes" + (f", top-k {w['topk_ratio']}" if w["topk_ratio"] else "")
        + (f", buckets pipelined in {w['pipeline_chunk_mb']:g} MiB chunks" if w["pipeline_chunk_mb"] else ", unchunked"),
        "",
        "predicted all-reduce of the whole gradient in one bucket:",
    ]
    lines += [f"  {a:8s} {t * 1e3:10.2f} ms" for a, t in report["allreduce_s"].items()]
    lines += [f"  (bandwidth bound across nodes: {report['bandwidth_bound_s'] * 1e3:.2f} ms)"]
    flat = report["flat_baseline"]
    detail = f"{flat['backend']} flat all-reduce, {flat['source']}"
    if flat["nccl_ring_s"] is not None:
        detail += f"; NCCL ring {flat['nccl_ring_s'] * 1e3:.2f} ms, tree {flat['nccl_tree_s'] * 1e3:.2f} ms (model)"
    lines += [f"  baseline, plain DDP in fp32: {flat['seconds'] * 1e3:.2f} ms ({detail})", ""]
    auto, two, cap = f["auto"], f["two_segment"], f["best_bucket_cap_mb"]
    lines += [
        f"chosen algorithm: {report['chosen_algorithm']}  (predicted end of communication after backward start: "
        + ", ".join(f"{a} {t * 1e3:.2f} ms" for a, t in f["per_algorithm_finish_s"].items()) + ")",
        f"  {report['plan_reason']}" if report["plan_reason"] else "",
        f"fusion plan: {auto['num_buckets']} buckets, MiB in backward order: {auto['bucket_mb']}",
        f"  exposed communication {auto['exposed_s'] * 1e3:.2f} ms; DDP arguments for exactly this plan: {f['ddp_kwargs']}",
        f"  best single bucket_cap_mb={cap['bucket_cap_mb']:.2f} ({cap['num_buckets']} buckets, exposed "
        f"{cap['exposed_s'] * 1e3:.2f} ms)",
        f"  two-segment plan: split between {two['split_between']} (exposed {two['exposed_s'] * 1e3:.2f} ms)",
        "pipeline chunk (MiB) -> predicted end of communication (best algorithm and buckets each): "
        + ", ".join(f"{c} {t * 1e3:.2f} ms" for c, t in report["pipeline_chunk"]["finish_s_by_chunk_mb"].items())
        + f"; best: {report['pipeline_chunk']['best_mb'] or 'unchunked'}",
        *_bn_span_lines(report["bn_span"]),
        "",
        f"step: compute {s['compute_s'] * 1e3:.2f} ms + exposed comm {s['exposed_comm_s'] * 1e3:.2f} ms"
        + (f" + BN statistics {s['bn_sync_s'] * 1e3:.2f} ms" if report["bn_span"] else "")
        + f" = {s['step_s'] * 1e3:.2f} ms; scaling efficiency {s['efficiency'] * 100:.2f}%, "
        f"{s['images_per_s']:.0f} samples/s",
        "",
        f"scaling efficiency (weak scaling, fusion {report['scaling']['fusion']}):",
        f"  {'GPUs':>6s} {'nodes':>6s} " + " ".join(f"{a:>9s}" for a in ALGORITHMS),
    ]
    by_gpus: dict[int, dict] = {}
    for point in report["scaling"]["points"]:
        by_gpus.setdefault(point["gpus"], {"nodes": point["nodes"]})[point["algorithm"]] = point["efficiency"]
    for gpus, row in sorted(by_gpus.items()):
        lines.append(f"  {gpus:6d} {row['nodes']:6d} " + " ".join(f"{row[a] * 100:8.2f}%" for a in ALGORITHMS))
    return "\n".join(lines)


def _bn_span_lines(bn: dict | None) -> list[str]:
    if bn is None:
        return []
    if bn["ranks_per_group"] == 1:
        return [f"BN span {bn['span']}: ghost groups on each device, no communication"]
    where = f"across {bn['group_nodes']} nodes" if bn["group_nodes"] > 1 else "inside a node"
    line = (f"BN span {bn['span']}: groups of {bn['ranks_per_group']} ranks {where}; {bn['bn_layers']} BN layers "
            f"x 2 all-reduces of their statistics add {bn['sync_s'] * 1e3:.2f} ms per step, not overlapped")
    if bn["group_nodes"] > 1:
        line += (f"; every BN layer waits on the link between nodes twice a step (bn_span="
                 f"{bn['widest_span_in_node']}, the widest inside a node: {bn['widest_span_in_node_sync_s'] * 1e3:.2f} ms)")
    return [line]


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algorithm in ALGORITHMS:
        points = [p for p in report["scaling"]["points"] if p["algorithm"] == algorithm]
        ax.plot([p["gpus"] for p in points], [100 * p["efficiency"] for p in points], marker="o", label=algorithm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title(f"{report['workload']['model']} on {report['cluster']['name']} (predicted)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastscale-plan`` console script."""
    args = _parser().parse_args(argv)
    if args.list_clusters:
        print("\n".join(available_clusters()))
        return 0
    if args.crossover:
        rows = crossover_table()
        print(json.dumps(rows, indent=2) if args.json else format_crossover(rows))
        return 0
    if args.cluster is None and args.model is not None:
        args.model, args.cluster = None, args.model  # `fastscale-plan CLUSTER`: the workload's model
    if args.cluster is None:
        _parser().error("give a cluster (YAML path or one of: " + ", ".join(available_clusters()) + ")")
    try:
        cluster = load_cluster(args.cluster)
        report = build_report(cluster, args.model, args.gpus, args.per_gpu_batch, args.input_size,
                              args.wire_dtype, args.topk_ratio, args.fusion, args.max_gpus,
                              args.pipeline_chunk_mb if args.pipeline_chunk_mb != 0 else None, args.bn_span)
    except (ClusterConfigError, ValueError) as err:
        print(f"fastscale-plan: error: {err}", file=sys.stderr)
        return 2
    if args.plot:
        _plot(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else _text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
