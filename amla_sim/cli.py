"""The ``amla-sim`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import __version__
from ._validate import DataError, dumps_strict
from .bits import as_int, lemma_domain, mul_pow2_via_int_add
from .formats import get_format

if TYPE_CHECKING:
    from .comparison import ComparisonReport
    from .crosscheck.report import ReplayReport


def lemma_examples(fmt_name: str = "fp32") -> list[tuple[str, float, int]]:
    """(case, x, n) triples: Fig. 3, cases inside Lemma 3.1's domain, and each way out of it, for one format."""
    f = get_format(fmt_name)
    top = (1 << f.exponent_bits) - 1  # the all-ones exponent field: Inf and NaN

    def value(e_field: int, frac: float = 0.0) -> float:
        return float(np.ldexp(1.0 + frac, e_field - f.bias))

    return [
        (f"Fig. 3: 0.5 is {f.bias - 1} * 2^{f.mantissa_bits} as INT", 0.5, 0),
        ("in domain: 0.5 * 2^1", 0.5, 1),
        ("in domain: 3 * 2^5", 3.0, 5),
        ("in domain: -1.5 * 2^-10", -1.5, -10),
        (f"in domain: smallest normal * 2^{top - 2}", f.min_normal, top - 2),
        ("out: zero (E = 0), n = -3", 0.0, -3),
        ("out: zero (E = 0), n = +3", 0.0, 3),
        ("out: subnormal (E = 0), n = +1", 3 * f.min_subnormal, 1),
        ("out: exponent underflow (E + n <= 0)", value(7), -10),
        (f"out: E + n = {top} (Inf)", value(top - 28), 28),
        (f"out: exponent overflow (E + n > {top})", value(top - 28, 0.25), 40),
    ]


def _lemma_rows(fmt_name: str) -> list[dict[str, object]]:
    fmt = get_format(fmt_name)
    rows = []
    width = 2 * fmt.dtype.itemsize
    for case, x, n in lemma_examples(fmt_name):
        with np.errstate(over="ignore", under="ignore"):
            xv = np.array(x).astype(fmt.dtype)
            got = mul_pow2_via_int_add(xv, n)
            x64 = xv.astype(np.float64)
            exact = float(np.ldexp(x64, n))  # Inf where even float64 cannot hold it
            representable = np.isfinite(exact) and np.ldexp(exact, -n) == x64
        ix, ig = int(as_int(xv)), int(as_int(got))
        mask = (1 << (4 * width)) - 1
        rows.append(
            {
                "case": case,
                "x": float(xv.astype(np.float64)),
                "x_bits": f"0x{ix & mask:0{width}x}",
                "x_as_int": ix,
                "n": n,
                "int_add": float(got.astype(np.float64)),
                "int_add_bits": f"0x{ig & mask:0{width}x}",
                "x_times_2^n": exact,
                "in_domain": bool(lemma_domain(xv, n)),
                "bitwise_equal": bool(
                    representable
                    and float(got.astype(np.float64)) == exact
                    and np.signbit(got.astype(np.float64)) == np.signbit(exact)
                ),
            }
        )
    return rows


def _cmd_lemma(args: argparse.Namespace) -> int:
    rows = _lemma_rows(args.format)
    if args.json:
        print(dumps_strict({"format": args.format, "examples": rows}, indent=2))
        return 0
    print(f"Lemma 3.1 on {args.format}: AS_FLOAT(AS_INT(x) + n * 2^m) against x * 2^n\n")
    hdr = f"{'case':40s} {'x':>12s} {'bits':>10s} {'n':>4s}   {'int add':>13s} {'bits':>10s}   {'x * 2^n':>13s}  dom  ok"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['case']:40s} {r['x']:12.5g} {r['x_bits']:>10s} {r['n']:4d}   {r['int_add']:13.5g}"
            f" {r['int_add_bits']:>10s}   {r['x_times_2^n']:13.5g}  {'yes' if r['in_domain'] else 'no ':3s}"
            f"  {'=' if r['bitwise_equal'] else 'X'}"
        )
    fig3 = rows[0]
    f = get_format(args.format)
    print(f"\n0.5 as INT = {fig3['x_as_int']} = {f.bias - 1} * 2^{f.mantissa_bits}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .algorithms import golden
    from .experiments.inputs import make_inputs
    from .experiments.metrics import all_metrics
    from .experiments.specs import parse_algorithm
    from .machines import get_machine
    from .plugins import call_algorithm, get_algorithm
    from .resources import check_fits, run_bytes

    mc = get_machine(args.machine)
    try:
        _, name, spec_options = parse_algorithm(args.algorithm)
    except ValueError as e:  # name the flag the user wrote
        raise type(e)("--algorithm: " + str(e).removeprefix("algorithms: ")) from None
    args.algorithm = name
    _check_options(args)
    if args.max_memory is not None and args.max_memory >= 2**33:  # bytes past an int64
        raise ValueError(f"--max-memory: expected fewer than {2**33} GiB, got {args.max_memory:g}")
    need = run_bytes(batch=args.batch, sq=args.sq, heads=args.heads, context=args.context,
                     mufu_tables=mc.exponential.mode == "sm90" or mc.division.mode == "sm90")
    check_fits(need, what=f"run (b={args.batch}, s_q={args.sq}, G={args.heads}, context={args.context})",
               lower="--context, --heads, --batch or --sq", limit=_limit(args))
    q, kv = make_inputs(args.dist, batch=args.batch, heads=args.heads, sq=args.sq, context=args.context,
                        seed=args.seed, fmt="fp32" if args.algorithm == "snapmla" else "bf16")
    options = {k: v for k, v in (("compensation", args.compensation), ("scaling", args.scaling),
                                 ("config", args.config)) if v is not None}
    if args.no_cleanup:
        options["cleanup"] = False
    options.update(spec_options)
    ref = golden(q, kv, scale=args.scale)  # (the algorithm gets read-only views: it cannot change these)
    t0 = time.perf_counter()
    res = call_algorithm(name, get_algorithm(name), q, kv,
                         **{"machine": mc, "schedule": args.schedule, "scale": args.scale, "block": args.block,
                            **options})  # a spec's own schedule wins over --schedule, as in sweep
    seconds = time.perf_counter() - t0
    report = {
        "algorithm": args.algorithm,
        "machine": mc.name,
        "schedule": args.schedule,
        "options": options,
        "shape": {"batch": args.batch, "sq": args.sq, "heads": args.heads, "context": args.context,
                  "block": args.block},
        "dist": args.dist,
        "seed": args.seed,
        **all_metrics(res.out, ref.out),
        "hazards": dict(res.hazards),
        "seconds": round(seconds, 3),
    }
    if args.json:
        print(dumps_strict(report, indent=2))
        return 0
    print(f"{args.algorithm} on {mc.name} ({args.dist}, b={args.batch} s_q={args.sq} G={args.heads} "
          f"L={args.context} block={args.block}) in {seconds:.2f} s, against the FP64 golden:")
    for key in ("rel_frobenius", "rmse", "cos_diff", "max_abs"):
        print(f"  {key:14s} {report[key]:.4e}")
    print(f"  hazards        {report['hazards'] or 'none'}")
    return 0


_ALGORITHM_OPTIONS = {"compensation": "amla", "scaling": "amla", "no_cleanup": "amla", "config": "snapmla"}


def _check_options(args: argparse.Namespace) -> None:
    """Options of one algorithm given to another: an error naming the option."""
    for opt, alg in _ALGORITHM_OPTIONS.items():
        if getattr(args, opt) not in (None, False) and args.algorithm != alg:
            flag = "--" + opt.replace("_", "-")
            raise ValueError(f"{flag}: applies to --algorithm {alg} only, not {args.algorithm}")


def _limit(args: argparse.Namespace) -> int | None:
    return None if args.max_memory is None else int(args.max_memory * 2**30)


def _capture_deployed(args: argparse.Namespace) -> ReplayReport:
    """Run a deployed kernel's case table on this GPU (or fail saying why not), then replay the capture."""
    from .crosscheck import replay
    from .crosscheck.deployed import KERNELS, capture
    from .gpu import GPUUnavailable, gpu_status

    why = gpu_status()
    if why is not None:
        raise GPUUnavailable(f"crosscheck --kernel {args.kernel} needs a GPU ({why}); replay a capture with "
                             "--replay FILE (tests/data/sglang_decode.npz is one)")
    import tempfile

    spec = KERNELS[args.kernel]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.save or os.path.join(tmp, "capture.npz")
        capture(args.kernel, path, source=getattr(args, _dest(spec.source_flag)), seed=args.seed,
                scales=args.scales, build=args.build or "upstream")
        return replay(path, kernel=args.kernel)


def _capture_own(args: argparse.Namespace) -> ReplayReport:
    """This project's kernel on the GPU (or torch's ops against ieee32), stage by stage."""
    from .crosscheck.own import compare_stages, replay_own, run_stages, save_capture
    from .crosscheck.report import ReplayReport
    from .experiments.inputs import make_inputs

    try:
        b, sq, G, L = (int(v) for v in args.shape.split(","))
    except ValueError:
        raise ValueError(f"shape: expected b,sq,G,L such as 1,1,128,1024, got {args.shape!r}") from None
    if args.backend == "torch":
        from .gpu.torch_machine import torch_machine

        mc = torch_machine(args.device)
        q, kv = make_inputs(args.dist, batch=b, sq=sq, heads=G, context=L, seed=args.seed)
        device = f"torch on {args.device}"
        report = compare_stages(args.algorithm, run_stages(args.algorithm, q, kv, machine=mc),
                                run_stages(args.algorithm, q, kv, machine="ieee32"), device=device,
                                exp_mode="torch", machine="ieee32")
        return ReplayReport(kernel="amla-sim", version=args.algorithm, device=device, cases=[report],
                            title=f"{args.algorithm} on {device} (exp mode torch) against ieee32:")
    from .gpu import GPUUnavailable, gpu_status

    why = gpu_status()
    if why is not None:
        raise GPUUnavailable(f"crosscheck needs a GPU ({why}); replay a saved capture with --replay FILE")
    from .crosscheck.own import device_run

    q, kv = make_inputs(args.dist, batch=b, sq=sq, heads=G, context=L, seed=args.seed)
    div = "ieee" if args.exp == "poly" else "hw"
    import tempfile

    import torch

    dev = device_run(args.algorithm, q, kv, exp_mode=args.exp, div_mode=div, debug=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.save or os.path.join(tmp, "capture.npz")
        save_capture(path, algorithm=args.algorithm, q=q, kv=kv, scale=None, exp_mode=args.exp,
                     div_mode=div, device_name=torch.cuda.get_device_name(), device=dev)
        return replay_own(path)


def _cmd_crosscheck(args: argparse.Namespace) -> int:
    if args.scales is not None and (args.replay or (args.kernel or "amla-sim") == "amla-sim"):
        raise ValueError("--scales: runs a deployed --kernel's scale table on a GPU (a replay reads the scales its "
                         "capture records)")
    if args.build is not None and (args.replay or (args.kernel or "amla-sim") == "amla-sim"):
        raise ValueError("--build: which library of a deployed --kernel to run on a GPU (a replay follows the build "
                         "its capture records)")
    if args.replay:
        from .crosscheck import CaptureError, replay

        try:
            report = replay(args.replay, kernel=args.kernel)
        except CaptureError as e:  # every error about the file names it
            if args.replay in str(e):
                raise
            raise CaptureError(f"replay: {args.replay}: {str(e).removeprefix('replay: ')}") from None
    elif (args.kernel or "amla-sim") == "amla-sim":
        report = _capture_own(args)
    else:
        report = _capture_deployed(args)
    print(report.to_json(indent=2) if args.json else report.format())
    return exit_code(report)


def _cmd_invariance(args: argparse.Namespace) -> int:
    """The study, or the device check's replay; every error names the flag (and the file) at fault."""
    from .invariance import invariance
    from .invariance.checks import replay_invariance

    given = {"--length": args.length, "--heads": args.heads, "--dist": args.dist, "--seed": args.seed,
             "--inputs": args.inputs, "--batchmates": args.batchmates, "--mixed": args.mixed, "--num-sms": args.num_sms,
             "--sq": args.sq, "--num-kv-splits": args.num_kv_splits, "--projection": args.projection,
             "--split-tokens": None if args.split_tokens is False else args.split_tokens, "--tokens": args.tokens,
             "--format": args.format, "--max-context-len": args.max_context_len}
    if args.replay:
        extra = [f for f, v in given.items() if v is not None]
        if extra:
            raise ValueError(f"--replay: the device check fixes its request and launches; drop {', '.join(extra)}")
        code = 0
        try:
            rows = replay_invariance(args.replay, args.kernel)
        except (ValueError, TypeError) as e:
            raise (DataError if isinstance(e, DataError) else type(e) if type(e) is TypeError else ValueError)(
                _flag_names(str(e), files={"replay": args.replay})) from None
        if args.json:
            print(dumps_strict([{"launch": lab, **rep.to_dict()} for lab, rep in rows], indent=2))
        for lab, rep in rows:
            code = max(code, exit_code(rep))
            if not args.json:
                pct = ", ".join(f"{s.name} {100 * s.bit_exact:.3f}%" for s in rep.stages)
                print(f"{lab}: {rep.meta['splits']} splits; the model against the device: {pct}")
        if not args.json:
            print("every launch's bits as predicted" if code == 0 else "the model missed bits of a launch")
        return code
    options = {k: v for k, v in (("tokens", args.tokens), ("format", args.format),
                                 ("max_context_len", args.max_context_len)) if v is not None}
    inputs = None
    if args.inputs:
        extra = [f for f in ("--length", "--heads", "--dist", "--seed") if given[f] is not None]
        if extra:
            raise ValueError(f"--inputs: the request is the file's (its length, heads and values); drop "
                             f"{', '.join(extra)}")
        import ml_dtypes

        from .crosscheck.files import read_capture

        _, inputs = read_capture(args.inputs, what="--inputs", need_meta=False)
        # np.save writes BF16 (and FP16 from ml_dtypes) as 2-byte void words; the help also allows uint16 bits:
        # both are read as --format (BF16 by default)
        as16 = np.float16 if args.format == "fp16" else ml_dtypes.bfloat16
        inputs = {k: (a.view(as16) if (a.dtype.kind == "V" and a.dtype.itemsize == 2) or a.dtype == np.uint16
                      else a) for k, a in inputs.items()}
    projection = None
    if args.projection:
        try:
            projection = np.load(args.projection, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"--projection: {args.projection} is not a .npy array ({e})") from None
        if not isinstance(projection, np.ndarray):
            if hasattr(projection, "close"):
                projection.close()  # an .npz archive holds its file open
            raise ValueError(f"--projection: {args.projection} is not a .npy array (an .npz archive?)")
    try:
        report = invariance(args.kernel, length=4096 if args.length is None else args.length,
                            heads=128 if args.heads is None else args.heads, dist="flashmla" if args.dist is None else args.dist,
                            seed=0 if args.seed is None else args.seed, inputs=inputs, batchmates=(1, 3, 7) if args.batchmates is None
                            else args.batchmates, mixed=3 if args.mixed is None else (args.mixed or None),
                            num_sms=args.num_sms or (132,), s_q=args.sq or (1,), num_kv_splits=args.num_kv_splits or (),
                            projection=projection, split_tokens=args.split_tokens, max_memory=_limit(args), **options)
    except (ValueError, TypeError) as e:  # name the flag the user wrote
        raise (type(e) if type(e) is TypeError else ValueError)(
            _flag_names(str(e), files={"inputs": args.inputs, "projection": args.projection})) from None
    print(dumps_strict(report.to_dict(), indent=2) if args.json else report.format())
    if not all(r.comparison.bit_exact for r in report.results):
        return 3
    return 4 if any(report.nan.values()) else 0


def _flag_names(text: str, flags: Sequence[str] | None = None, files: dict[str, str | None] | None = None) -> str:
    """An error of the library as the command line says it: the argument names it opens with (``num_sms:``,
    ``length, heads, s_q:``) as the flags of the command (`flags`; None: invariance's), a file's flag followed by
    the file (`files`: argument -> path) unless the message names it already."""
    names = {"num_kv_splits": "--num-kv-splits", "num_sms": "--num-sms", "s_q": "--sq", "split_tokens": "--split-tokens",
             "max_context_len": "--max-context-len", "batchmates": "--batchmates", "mixed": "--mixed",
             "projection": "--projection", "inputs": "--inputs", "length": "--length", "heads": "--heads",
             "tokens": "--tokens", "dist": "--dist", "seed": "--seed", "kernel": "--kernel", "format": "--format",
             "replay": "--replay"}
    head, sep, rest = text.partition(":")
    args = [a.strip() for a in head.split(",")]
    if not sep or not all(a in names for a in args):
        return text
    if flags is not None:
        args = [a for a in args if names[a] in flags] or args
    out = ", ".join(names[a] if flags is None or names[a] in flags else a for a in args)
    path = (files or {}).get(args[0]) if len(args) == 1 else None
    if path and path not in rest:
        out += f": {path}"
    return out + sep + rest


def _cmd_diff(args: argparse.Namespace) -> int:
    """Two kernels on one request; every error names a flag of ``diff``."""
    from .invariance import kernel_diff

    if len(args.kernel or ()) != 2:
        raise ValueError(f"--kernel: name two kernels (--kernel A --kernel B), got {len(args.kernel or ())}")
    try:
        report = kernel_diff(*args.kernel, length=4096 if args.length is None else args.length,
                             heads=128 if args.heads is None else args.heads, dist="flashmla" if args.dist is None else args.dist,
                             seed=0 if args.seed is None else args.seed, s_q=args.sq, num_sms=args.num_sms, max_memory=_limit(args))
    except (ValueError, TypeError) as e:
        flags = ("--kernel", "--length", "--heads", "--dist", "--seed", "--sq", "--num-sms", "--max-memory")
        raise (type(e) if type(e) is TypeError else ValueError)(_flag_names(str(e), flags=flags)) from None
    print(dumps_strict(report.to_dict(), indent=2) if args.json else report.format())
    code = exit_code(report.comparison)
    return 4 if code == 0 and not report.identical else code  # NaN in both: no answer


def _cmd_compare(args: argparse.Namespace) -> int:
    from .comparison import compare
    from .crosscheck.files import read_capture

    sides = []
    for arg, path in (("device", args.device), ("simulated", args.simulated)):
        if not path:
            raise ValueError(f"{arg}: expected a .npz file, got ''")
        meta, arrays = read_capture(path, what="compare", need_meta=False)
        # np.save writes ml_dtypes' types as raw void words: read them as the bits they are
        sides.append({k: (a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "V" else a) for k, a in arrays.items()})
    formats = dict(args.format or ())
    if len(formats) != len(args.format or ()):
        raise ValueError("--format: a stage is given more than one format")
    try:
        report = compare(*sides, stages=list(args.stages) if args.stages else None, formats=formats,
                         meta={"device": args.device, "simulated": args.simulated})
    except (ValueError, TypeError) as e:  # name the flag the user wrote
        raise type(e)(str(e).replace("stages:", "--stages:", 1).replace("formats:", "--format:", 1)) from None
    if args.json:
        print(report.to_json(indent=2))
    else:
        print(f"{args.device} against {args.simulated}:\n{report}")
    return exit_code(report)


def exit_code(report: ComparisonReport | ReplayReport) -> int:
    """What a comparing command exits with: 0 bit-identical, 3 bits differ, 4 nothing differs but a stage or case
    was not compared (held by one side only, or empty)."""
    if report.bit_exact:
        return 0
    cases = getattr(report, "cases", [report])
    return 3 if any(r.first_difference is not None for r in cases) else 4


def _stage_format(text: str) -> tuple[str, str]:
    name, eq, fmt = text.partition("=")
    if not eq or not name or not fmt:
        raise argparse.ArgumentTypeError(f"expected STAGE=FORMAT such as out=bf16, got {text!r}")
    try:
        get_format(fmt, argname=f"stage {name}")
    except ValueError as e:  # (argparse would say only "invalid value")
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, fmt


def _floats(text: str, argname: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"{argname}: expected comma-separated numbers such as 3,2,4, got {text!r}") from None


def _cmd_pipeline(args: argparse.Namespace) -> int:
    from .pipeline import construct_cycle, simulate
    from .plots import GANTT_MAX_STAGES

    cube, vector = _floats(args.cube, "--cube"), _floats(args.vector, "--vector")
    if args.plot is not None:
        _check_output_file(args.plot, "--plot", suffix=".png")
        if 2 * len(cube) * args.cycles > GANTT_MAX_STAGES:  # every stage a labelled bar: unreadable, and slow
            raise ValueError(f"--plot: a Gantt chart of at most {GANTT_MAX_STAGES} stages (2 x pairs x cycles), "
                             f"got 2 x {len(cube)} x {args.cycles}; lower --cycles, or leave out --plot")
    from .resources import check_fits, pipeline_bytes

    check_fits(pipeline_bytes(pairs=len(cube), cycles=args.cycles), what=f"pipeline --cycles {args.cycles}",
               lower="--cycles")
    try:
        cycle = construct_cycle(cube, vector)
        tl = simulate(cube, vector, cycle, iterations=args.cycles)
    except ValueError as e:  # the library's argument names as the flags
        text = str(e)
        for arg, flag in (("cube and vector", "--cube and --vector"), ("cube", "--cube"), ("vector", "--vector"),
                          ("iterations", "--cycles")):
            if text.startswith(f"{arg}:"):
                text = flag + text[len(arg):]
                break
        raise ValueError(text) from None
    report = {
        "case": cycle.case,
        "k": cycle.k,
        "cube_order": [f"C{i + 1}" for i in cycle.cube_order],
        "vector_order": [f"V{i + 1}" for i in cycle.vector_order],
        "internal_chains": cycle.internal_chains,
        "chains": [f"C{i + 1}->V{i + 1}" for _, i in sorted(cycle.internal)],
        "preload_count": cycle.preload_count,
        "total_time": tl.total_time,
        "cube_utilization": tl.cube_utilization,
        "steady_cube_idle": tl.steady_cube_idle,
        "steady_vector_idle": tl.steady_vector_idle,
    }
    if args.plot:
        from .plots import gantt

        gantt(tl, args.plot, title=f"Preload pipeline: {cycle.describe()}")
        report["plot"] = args.plot
    if args.json:
        print(dumps_strict(report, indent=2))
        return 0
    print(f"{cycle.case} (sum C = {sum(cube):g}, sum V = {sum(vector):g}); k = {cycle.k}")
    print(f"Cycle: {cycle.describe()}")
    print(f"internal chains {cycle.internal_chains}, preload count {cycle.preload_count}")
    print(f"{args.cycles} iterations: total time {tl.total_time:g}, Cube utilization {100 * tl.cube_utilization:.1f}%,"
          f" steady-loop idle: Cube {tl.steady_cube_idle:g}, Vector {tl.steady_vector_idle:g}")
    return 0


def _cmd_roofline(args: argparse.Namespace) -> int:
    from .roofline import TABLE2, compute_bound_threshold, intensity

    rows = [{"variant": s.name, "q_heads": s.n1, "kv_heads": s.n2, "s_q": s.s1, "intensity": intensity(s),
             "paper": paper} for s, paper in TABLE2]
    try:
        thr = compute_bound_threshold(args.peak, args.bandwidth)
        exact = compute_bound_threshold(args.peak, args.bandwidth, flashmla_approximation=False)
    except ValueError as e:
        raise ValueError(str(e).replace("peak_tflops and bandwidth_tbs", "--peak and --bandwidth", 1)) from None
    if args.json:
        print(dumps_strict({"table2": rows, "threshold_hq_sq": thr, "threshold_hq_sq_exact": exact}, indent=2))
        return 0
    print("AMLA paper Table 2: arithmetic intensity (FLOPs / byte of KV cache)")
    print(f"  {'variant':20s} {'Q heads':>7s} {'KV heads':>8s} {'S_q':>4s} {'ours':>8s} {'paper':>6s}")
    for r in rows:
        print(f"  {r['variant']:20s} {r['q_heads']:7d} {r['kv_heads']:8d} {r['s_q']:4d} {r['intensity']:8.1f}"
              f" {r['paper']:>6}")
    def num(x: float) -> str:  # one decimal where that reads well, else three digits and an exponent
        return f"{x:.1f}" if 0.05 <= x < 1e6 else f"{x:.3g}"

    print(f"compute-bound when h_q s_q >= {num(thr)} at {args.peak:g} TFLOP/s and {args.bandwidth:g} TB/s "
          f"(FlashMLA's (Dk + Dv)/Dk ~ 2; exactly 1.89: {num(exact)})")
    return 0


def _check_output_file(path: str, flag: str, suffix: str | None = None) -> None:
    """A file the command will write: a name (with `suffix`, where the format follows it) in a folder that exists,
    and not a folder or a device (the file is replaced whole)."""
    p = Path(path)
    if not path:
        raise ValueError(f"{flag}: expected a file name, got ''")
    if p.is_dir():
        raise ValueError(f"{flag}: {path} is a folder; name a file in it")
    if p.exists() and not p.is_file():
        raise ValueError(f"{flag}: {path} is not a regular file")
    if suffix is not None and p.suffix.lower() != suffix:
        raise ValueError(f"{flag}: expected a file name ending in {suffix}, got {path!r}")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise ValueError(f"{flag}: the folder {parent} does not exist")


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from .experiments.sweep import check_table, run_table, table_markdown
    from .experiments.tables import TABLES

    names = [t.strip() for t in args.table.split(",")]
    if "all" in names and len(names) > 1:
        raise ValueError(f"table: 'all' (every table) stands alone, got {args.table!r}")
    names = sorted(TABLES) if names == ["all"] else names
    bad = [n for n in names if n not in TABLES]
    if bad:  # every name checked before any work
        raise ValueError(f"table: expected names from {sorted(TABLES)} or 'all', got {bad[0]!r}")
    if not args.out:
        raise ValueError("--out: expected a folder, got ''")
    for name in dict.fromkeys(names):  # and every table's settings
        check_table(name, context=args.context, heads=args.heads, machine=args.machine, schedule=args.schedule,
                    algorithms=args.algorithms or (), samples=args.samples)
    for name in dict.fromkeys(names):
        res = run_table(name, out_dir=args.out, samples=args.samples, context=args.context, heads=args.heads,
                        machine=args.machine, schedule=args.schedule, seed=args.seed, jobs=args.jobs,
                        progress=not args.quiet, repair=args.repair, scheduler=args.scheduler, engine=args.engine,
                        algorithms=args.algorithms or ())
        print(table_markdown(res.summary))
        if res.computed:
            ratio = (f"{res.seconds * args.jobs / res.blas_seconds:.2f}" if res.blas_seconds > 0.01 * res.seconds
                     else "n/a, BLAS time too small to compare")
            print(f"{res.computed} new samples in {res.seconds:.1f} s; BLAS matmuls inside them: "
                  f"{res.blas_seconds:.1f} s of worker time (total / BLAS = {ratio} across {args.jobs} job(s))")
        print(f"files: {res.out_dir}/results.csv, summary.json, table.md, table.png\n")
    return 0


def _csv(kind: Callable[[str], object]) -> Callable[[str], tuple]:
    """An argparse type: a comma-separated list of `kind`."""

    def parse(text: str) -> tuple:
        items = [t.strip() for t in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return tuple(kind(t) for t in items)

    return parse


_GRID_FLAGS = {"algorithms": "algorithms", "machines": "machines", "dists": "distributions", "contexts": "contexts",
               "heads": "heads", "sq": "sq", "blocks": "blocks", "schedule": "schedule", "samples": "samples",
               "seed": "seed", "input_format": "input_format", "sampler": "sampler", "metric": "metric",
               "reference": "reference"}


def _sweep_grid(args: argparse.Namespace):
    from dataclasses import replace

    from .experiments.grid import Grid, load_grid
    from .experiments.tables import TABLES, table_grid

    given = {field: getattr(args, flag) for flag, field in _GRID_FLAGS.items() if getattr(args, flag) is not None}
    if args.grid == "":
        raise ValueError("--grid: expected a TOML file or a table name, got ''")
    if args.grid is None:
        if "algorithms" not in given:
            raise ValueError("algorithms: give --algorithms (e.g. base,amla) or a --grid file")
        return Grid(**given)
    if args.grid in TABLES and not Path(args.grid).is_file():  # (a folder of that name is not a grid file)
        grid = table_grid(args.grid)
    else:
        grid = load_grid(args.grid)
    return replace(grid, **given)  # flags override the file


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .experiments.grid import run_grid

    grid = _sweep_grid(args)
    if not args.out:
        raise ValueError("--out: expected a folder, got ''")
    res = run_grid(grid, out_dir=args.out, scheduler=args.scheduler, jobs=args.jobs, engine=args.engine,
                   progress=not args.quiet, repair=args.repair,
                   log=lambda line: print(line, file=sys.stderr, flush=True))
    from .experiments.grid import grid_markdown

    print(grid_markdown(res.summary))
    cells = len(grid.cells())
    print(f"{res.computed} new tasks ({cells} cells x {grid.samples} samples in all) in {res.seconds:.1f} s")
    print(f"files: {res.out_dir}/results.csv, grid.json, summary.json, summary.md, errors.png")
    return 0


def _int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an int >= lo (argparse names the option in its message)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {v}")
        return v

    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not np.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _sweep_flags(p: argparse.ArgumentParser) -> None:
    """What reproduce and sweep share: progress, repair, and where and on which engine the samples run."""
    from .engine import ENGINES

    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--repair", action="store_true",
                   help="keep every valid row of a damaged results.csv, set the other lines aside in results.rejected")
    p.add_argument("--jobs", type=_int_at_least(1), default=1,
                   help="local processes, or workers of --scheduler dask (default 1)")
    p.add_argument("--scheduler", default="local",
                   help="local (default), dask (a LocalCluster here) or tcp://HOST:PORT (an existing Dask cluster)")
    p.add_argument("--engine", default=os.environ.get("AMLA_SIM_ENGINE") or "numpy", choices=ENGINES,
                   help="numpy (the reference) or numba (compiled, same bits; the [fast] extra)")


def _add_lemma(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lemma", help="show the AMLA Lemma 3.1 bit trick in and out of its domain")
    p.add_argument("--format", default="fp32", choices=["fp32", "fp16", "bf16", "fp64"], help="float format")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_lemma)


def _schedule_flag(p: argparse.ArgumentParser, default: str | None = "reference") -> None:
    from .schedules import SCHEDULES

    p.add_argument("--schedule", default=default, choices=sorted(SCHEDULES),
                   help="how a kernel lays the blocks out (default reference: the papers' pseudo-code; amla-sim-gpu: "
                        "this project's Triton kernels, whose bits sm90-triton predicts)")


def _add_run(sub: argparse._SubParsersAction) -> None:
    from .algorithms import ALGORITHMS
    from .machines import MACHINES

    p = sub.add_parser("run", help="run one algorithm on one machine and compare it with the FP64 golden")
    p.add_argument("--algorithm", required=True, metavar="SPEC",
                   help=f"{', '.join(sorted(ALGORITHMS))}, an entry point of amla_sim.algorithms, or "
                        "module:function; options as :key=value (snapmla:config=A)")
    p.add_argument("--machine", default="ieee32", choices=sorted(MACHINES))
    _schedule_flag(p)
    p.add_argument("--batch", type=_int_at_least(1), default=1)
    p.add_argument("--heads", type=_int_at_least(1), default=128)
    p.add_argument("--sq", type=_int_at_least(1), default=1, help="query tokens per step (MTP), causal within the step")
    p.add_argument("--context", type=_int_at_least(1), default=1024)
    p.add_argument("--block", type=_int_at_least(1), default=64)
    p.add_argument("--scale", type=_positive_float, default=None, help="softmax scale (default 576^-0.5; DeepSeek-V3: 0.1352)")
    p.add_argument("--dist", default="normal:1", help="normal:SIGMA | uniform:A | flashmla | fa3-outliers | rope-outliers")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--compensation", choices=["cann", "paper", "none"], help="amla only")
    p.add_argument("--scaling", choices=["pre", "post"], help="amla only")
    p.add_argument("--no-cleanup", action="store_true", help="amla only: skip CANN's |O| > 1e10 clean-up")
    p.add_argument("--config", choices=["snapmla", "A", "B", "C", "D"], help="snapmla only")
    p.add_argument("--max-memory", type=_positive_float, metavar="GIB",
                   help="memory to allow, GiB (default: what the machine has available); larger runs are refused")
    p.add_argument("--json", action="store_true", help="print JSON (non-finite numbers as \"inf\", \"nan\")")
    p.set_defaults(func=_cmd_run)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _add_crosscheck(sub: argparse._SubParsersAction) -> None:
    from .crosscheck.deployed import KERNELS

    p = sub.add_parser("crosscheck", help="a kernel against the simulator, stage by stage (or replay a capture)",
                       description="Run a kernel on this GPU and compare it with the simulator stage by stage, or "
                                   "replay a capture on the CPU. Exit status: 0 every stage of every case "
                                   "bit-identical, 3 bits differ, 4 a stage not compared, 1 or 2 an error.")
    p.add_argument("--kernel", choices=["amla-sim", *KERNELS],
                   help="amla-sim (the default): this project's Triton kernels; "
                        + "; ".join(f"{k.name}: {k.summary}" for k in KERNELS.values())
                        + ". With --replay: the kernel the capture must hold (default: whichever it holds)")
    by_flag: dict[str, list] = {}
    for k in KERNELS.values():
        by_flag.setdefault(k.source_flag, []).append(k)
    for flag, ks in by_flag.items():  # one flag may serve several kernels of one checkout
        p.add_argument(flag, dest=_dest(flag), help=f"--kernel {', '.join(k.name for k in ks)}: {ks[0].source_help}")
    p.add_argument("--algorithm", default="amla", choices=["base", "amla", "snapmla", "etap"])
    p.add_argument("--backend", default="triton", choices=["triton", "torch"],
                   help="triton: the kernels against sm90-triton; torch: the algorithm as torch ops against ieee32")
    p.add_argument("--device", default="cuda", help="torch device for --backend torch (cuda, cpu, npu)")
    p.add_argument("--shape", default="1,1,64,1024", help="b,s_q,G,context")
    p.add_argument("--exp", default="poly", choices=["poly", "hw"], help="kernel exp mode (poly: modelled exactly)")
    p.add_argument("--dist", default="normal:1")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--scales", type=_int_at_least(0), metavar="N",
                   help="a deployed --kernel: run its scale table instead of its cases (one small launch for each "
                        "of DeepSeek's softmax scales and N random ones in [0.03, 0.3]; descales and cache scales "
                        "drawn too)")
    p.add_argument("--build", choices=["upstream", "vllm", "sglang"],
                   help="FlashMLA's kernels and fa3-mla: upstream (the default: this project's build of the checkout "
                        "its flag names), vllm (vLLM 0.33.0's shipped libraries: the flag names the folder its wheel "
                        "unpacks to) or sglang (FlashMLA's only: sgl-flash-mla 1.0.0's, the folder its wheel unpacks "
                        "to)")
    p.add_argument("--save", help="write inputs and device stages to this .npz")
    p.add_argument("--replay", help="compare a saved capture on the CPU (no GPU needed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_crosscheck)


def _request_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--length", type=_int_at_least(1),
                   help="the request's tokens (the sparse decode: its topk slots, a multiple of 64; default 4096)")
    p.add_argument("--heads", type=_int_at_least(1), help="the request's query heads (default 128)")
    p.add_argument("--dist", help="the inputs' distribution (normal:SIGMA, uniform:A, flashmla, fa3-outliers, "
                                  "rope-outliers; default flashmla)")
    p.add_argument("--seed", type=_int_at_least(0), help="the inputs' seed (default 0)")
    p.add_argument("--max-memory", type=_positive_float, metavar="GIB",
                   help="memory to allow, GiB (default: what the machine has available); larger runs are refused")
    p.add_argument("--json", action="store_true", help="the report as strict JSON")


def _add_invariance(sub: argparse._SubParsersAction) -> None:
    from .invariance import BATCH_KERNELS

    p = sub.add_parser("invariance", help="does a request's output change with its batchmates, and why",
                       description="Run one request alone and in other launches (batchmates of its length and of "
                                   "other lengths, other SM counts, more query rows, split counts) through a "
                                   "kernel's model, and say per launch which bits change and which split plan "
                                   "caused it. Exit status: 0 no launch changed a bit, 3 some did, 4 none did but "
                                   "the request's outputs hold NaN (not an answer; --replay: 0 every launch of the "
                                   "device check as predicted, 3 not), 1 or 2 an error.")
    p.add_argument("--kernel", required=True, choices=sorted(BATCH_KERNELS),
                   help="; ".join(f"{k}: {v}" for k, v in BATCH_KERNELS.items()))
    _request_flags(p)
    p.add_argument("--inputs", help=".npz with q (s_q, heads, 576) and kv (length, 576) of one request, BF16 (or "
                                    "their uint16 bits; FP16 with --format fp16): the request, in place of --length, "
                                    "--heads, --dist and --seed")
    p.add_argument("--batchmates", type=_csv(_int_at_least(1)),
                   help="launches with this many more requests of the request's length (default 1,3,7)")
    p.add_argument("--mixed", type=_int_at_least(0),
                   help="a launch with this many batchmates of drawn lengths, the request first, and one with it "
                        "last (0: none; default 3)")
    p.add_argument("--num-sms", type=_csv(_int_at_least(1)),
                   help="SM counts; the first is the reference's, each other one a launch (default 132; 114: H100 "
                        "PCIe)")
    p.add_argument("--sq", type=_csv(_int_at_least(1)),
                   help="query rows a request (MTP, speculative verify); the first the reference's (default 1)")
    p.add_argument("--num-kv-splits", type=_csv(_int_at_least(1)),
                   help="split counts handed to a kernel whose API takes one (sglang-triton's and vllm-triton-mla's "
                        "num_kv_splits; fa3-mla's num_splits as vLLM passes it: 32 with full CUDA graphs, 1 "
                        "batch-invariant), a launch each")
    p.add_argument("--projection", help=".npy of (heads x 512, vocab) floats: report each launch's argmax of the "
                                        "row's logits")
    p.add_argument("--split-tokens", type=_split_tokens, default=False,
                   help="also the batch-invariant what-if: 'one' split a request, or splits of this many tokens "
                        "(FlashMLA's decodes: a multiple of 64; sglang-triton and vllm-triton-mla: cdiv(length, "
                        "N) splits; flashinfer-mla: its chunk length, kv_len_limit, any count; FA3's and the sparse "
                        "prefill take no split size, so 'one' only)")
    p.add_argument("--tokens", type=_int_at_least(1), help="flashmla-sparse-fp8: the tokens of the request's cache "
                                                           "its topk are chosen from (default 4 x --length)")
    p.add_argument("--format", choices=["bf16", "fp16", "e4m3"],
                   help="flashmla-etap, fa3-mla (bf16, fp16), fa3-prefill (bf16, e4m3): the inputs' format")
    p.add_argument("--max-context-len", type=_int_at_least(1),
                   help="sglang-triton: the model's context length, which sets max_kv_splits (default 163840)")
    p.add_argument("--replay", help="the device check's capture (tests/data/invariance_h200.npz; "
                                    "invariance_flashinfer_h100.npz for flashinfer-mla): each launch's "
                                    "captured bits against the model's prediction (no other flag but --kernel "
                                    "and --json)")
    p.set_defaults(func=_cmd_invariance)


def _split_tokens(text: str) -> int | None:
    """An argparse type: 'one' (None: one split a request) or a token count (each kernel checks its own)."""
    return None if text == "one" else _int_at_least(1)(text)


def _add_diff(sub: argparse._SubParsersAction) -> None:
    from .invariance import BATCH_KERNELS

    p = sub.add_parser("diff", help="two kernels on the same request: where they differ and the first modelled "
                                    "step that explains it",
                       description="Run two kernels (modelled kernels, built-in algorithms or plugins) on one "
                                   "request: the elements that differ, the ULP histogram, each kernel's numerics "
                                   "step by step and the first that differs, and whether running both on one "
                                   "split plan removes the difference. Exit status: 0 identical bits, 3 bits "
                                   "differ, 4 no compared bit differs but a stage was not compared (one kernel "
                                   "returns it alone) or the bits are NaN in both (no answer), 1 or 2 an error.")
    p.add_argument("--kernel", action="append", metavar="NAME", required=True,
                   help=f"twice: the two kernels ({', '.join(BATCH_KERNELS)}, an algorithm of amla-sim run with its "
                        "options, or a plugin's module:function); a modelled kernel may set its own launch: "
                        "NAME:num_sms=N, and NAME:num_kv_splits=N where its API takes a split count")
    _request_flags(p)
    p.add_argument("--sq", type=_int_at_least(1), default=1, help="query rows (the last is compared)")
    p.add_argument("--num-sms", type=_int_at_least(1), default=132, help="SMs of both kernels' launch")
    p.set_defaults(func=_cmd_diff)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="two .npz files of named stages, bit for bit (exit 3 when they differ)",
                       description="Compare the arrays of two .npz files stage by stage: bit-exact fraction, max and "
                                   "median ULP, histogram, NaN and Inf agreement, the first stage that differs, the "
                                   "stages not compared. Exit status: 0 every stage compared and bit-identical, 3 "
                                   "bits differ, 4 a stage held by one file only (or empty), 1 or 2 an error.")
    p.add_argument("device", help="the device's stages (.npz of named arrays: floats, or raw bits with --format)")
    p.add_argument("simulated", help="the simulator's stages (.npz)")
    p.add_argument("--stages", type=_csv(str), help="the stages to compare, in pipeline order (default: the names "
                                                    "both files hold, in the first file's order; a name only one "
                                                    "file holds is reported as not compared, exit 4)")
    p.add_argument("--format", action="append", type=_stage_format, metavar="STAGE=FORMAT",
                   help="read a stage held as raw bits in this format (bf16, fp16, e4m3, e5m2, fp32, fp64); "
                        "repeatable")
    p.add_argument("--json", action="store_true", help="the report as strict JSON")
    p.set_defaults(func=_cmd_compare)


def _add_reproduce(sub: argparse._SubParsersAction) -> None:
    from .machines import MACHINES

    p = sub.add_parser("reproduce", help="reproduce a paper's accuracy table (resumable; CSV, JSON, Markdown, PNG)")
    p.add_argument("table", help="amla-table3 | amla-table4 | etap-table1 | etap-table1-kernel | fp8-mla | "
                                 "snapmla-configs | all (or a,b)")
    p.add_argument("--samples", type=_int_at_least(1), default=None, help="samples per distribution (default 100)")
    p.add_argument("--context", type=_int_at_least(1), default=None, help="context length (default: the paper's)")
    p.add_argument("--heads", type=_int_at_least(1), default=None, help="query heads G (default: the paper's)")
    p.add_argument("--machine", default=None, choices=sorted(MACHINES),
                   help="default: the table's (sm90-cuda for fp8-mla, whose kernels are CUDA; else ieee32-fast)")
    _schedule_flag(p)
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--algorithms", type=_csv(str), metavar="SPECS",
                   help="more columns beside the paper's, on the same draws: e.g. mine=my_pkg.kernels:my_algo "
                        "(label=name:key=value; a name, an entry point or module:function)")
    p.add_argument("--out", default="results", help="output folder (one subfolder per table)")
    _sweep_flags(p)
    p.set_defaults(func=_cmd_reproduce)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from .experiments.grid import METRICS, REFERENCES
    from .experiments.layer import LAYER_ALGORITHMS
    from .machines import MACHINES

    p = sub.add_parser("sweep", help="any grid of algorithms, machines, distributions, contexts, heads, s_q, blocks "
                                     "(resumable; CSV, JSON, Markdown, PNG; local or Dask)")
    p.add_argument("--grid", help="a TOML file with the grid's fields, or a table name (amla-table3, ...); "
                                  "the flags below override it")
    p.add_argument("--algorithms", type=_csv(str),
                   help="e.g. base,amla,A=snapmla:config=A,mine=my_pkg.kernels:my_algo (label=name:key=value; a "
                        "name is a built-in, an entry point of amla_sim.algorithms, or module:function)")
    p.add_argument("--machines", type=_csv(str), help=f"from {', '.join(sorted(MACHINES))}")
    p.add_argument("--dists", type=_csv(str), help="e.g. normal:1,uniform:60,flashmla")
    p.add_argument("--contexts", type=_csv(_int_at_least(1)), help="e.g. 1024,8192")
    p.add_argument("--heads", type=_csv(_int_at_least(1)), help="query heads G, e.g. 64,128")
    p.add_argument("--sq", type=_csv(_int_at_least(1)), help="query tokens per step, e.g. 1,2")
    p.add_argument("--blocks", type=_csv(_int_at_least(1)), help="KV block sizes, e.g. 64,128")
    _schedule_flag(p, default=None)
    p.add_argument("--samples", type=_int_at_least(1), help="samples per cell (default 10)")
    p.add_argument("--seed", type=_int_at_least(0))
    p.add_argument("--input-format", dest="input_format", help="format of q and kv (default bf16)")
    p.add_argument("--sampler", choices=["round", "table"], help="how inputs are drawn (default round)")
    p.add_argument("--metric", choices=METRICS,
                   help="the metric of the Markdown table and the plot (all are stored)")
    p.add_argument("--reference", choices=REFERENCES,
                   help="what errors are measured against: golden (FP64 attention of the inputs, the default), "
                        "golden-bf16 (of their BF16 rounding), or layer (the MLA layer's FP64 attention; the "
                        f"algorithms are then the layer's paths: {', '.join(LAYER_ALGORITHMS)}; machine sm90-cuda)")
    p.add_argument("--out", required=True, help="output folder")
    _sweep_flags(p)
    p.set_defaults(func=_cmd_sweep)


def _add_pipeline(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="the Preload pipeline of Theorem 4.1 for given stage durations")
    p.add_argument("--cube", required=True, help="Cube stage durations C1,...,Cn")
    p.add_argument("--vector", required=True, help="Vector stage durations V1,...,Vn")
    p.add_argument("--cycles", type=_int_at_least(1), default=8, help="iterations to simulate")
    p.add_argument("--plot", help="write a Gantt chart PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_pipeline)


def _add_roofline(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roofline", help="arithmetic intensity (AMLA Table 2) and the compute-bound threshold")
    p.add_argument("--peak", type=_positive_float, default=865.0, help="peak TFLOP/s (default: H800 throttled, 865)")
    p.add_argument("--bandwidth", type=_positive_float, default=3.35, help="memory bandwidth TB/s (default: H800, 3.35)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_roofline)


_PREFILL_DECODE_WORK = 2e7  # (key, head) products a stack runs: a few minutes of the models on one core
_DENSE_WORK = 6e7  # a dense layer's (key, head) products (MHA-form units): a few minutes


def _cmd_prefill_decode(args: argparse.Namespace) -> int:
    """Each stack's prefill of the request against each listed token's decode; exit 3 when a token's bits part."""
    from .invariance.prefill_decode import STACKS, prefill_vs_decode, request_inputs, stack_work
    from .resources import check_fits

    if args.model == "dense":
        return _dense_prefill_decode(args)
    if args.stack not in ("all", *STACKS):
        raise ValueError(f"--stack: {args.stack} is a dense model's mode; V3.2's stacks are {', '.join(STACKS)} "
                         f"(or pass --model dense)")
    if args.budget is not None:
        raise ValueError("--budget: a dense model's scheduler budget; V3.2's prefill is one launch (or pass --model "
                         "dense)")
    args.topk = 2048 if args.topk is None else args.topk
    args.dist = "normal:1" if args.dist is None else args.dist
    if args.heads > 128:
        raise ValueError(f"--heads: the kernels take at most 128 query heads, got {args.heads}")
    stacks = list(STACKS) if args.stack == "all" else [args.stack]
    tokens = None if args.tokens is None else [t if t >= 0 else args.length + t for t in args.tokens]
    if tokens is not None and not all(0 <= t < args.length for t in tokens):
        raise ValueError(f"--tokens: expected positions in 0..{args.length - 1} (or -1 for the last), got "
                         f"{args.tokens}")
    twice = sorted({t for t in tokens or () if tokens.count(t) > 1})
    if twice:
        raise ValueError(f"--tokens: position{'s' * (len(twice) > 1)} {', '.join(map(str, twice))} listed twice "
                         f"({','.join(map(str, args.tokens))}; -1 is position {args.length - 1})")
    valid = np.minimum(np.arange(1, args.length + 1), args.topk)  # token t lists min(t + 1, topk) rows
    for name in stacks:
        work, held = stack_work(name, valid, heads=args.heads, tokens=len(tokens or range(min(4, args.length))),
                                decode_batch=args.decode_batch)
        if work > _PREFILL_DECODE_WORK:
            raise ValueError(f"--length, --topk, --heads: {name} runs {work:.3g} (key, head) products (the heads "
                             f"its kernels run, the keys they walk), over the {_PREFILL_DECODE_WORK:.0e} a CPU runs "
                             f"in a few minutes; ask for a shorter request")
        check_fits(held, what=f"prefill-decode --stack {name}", lower="--length or --topk", limit=_limit(args))
    q, kv, idx = request_inputs(args.length, heads=args.heads, topk=args.topk, dist=args.dist, seed=args.seed)
    reports = [prefill_vs_decode(s, q, kv, idx, tokens=tokens, decode_batch=args.decode_batch) for s in stacks]
    if args.json:
        print(dumps_strict([{"stack": r.stack.name, "hazards": r.hazards, "tokens": [
            {**vars(v), "identical": v.identical, "bits_identical": v.bits_identical} for v in r.tokens]}
            for r in reports], indent=2))
    else:
        print("\n".join(r.format() for r in reports))
    verdicts = [v for r in reports for v in r.tokens]
    if not all(v.bits_identical for v in verdicts):
        return 3
    return 0 if all(v.identical for v in verdicts) else 4


def _dense_prefill_decode(args: argparse.Namespace) -> int:
    """``--model dense``: each engine mode's layer, prefill against decode; exit 3 when a token's bits part, 5 when
    they agree but a piece of either side is not device-checked."""
    from .algorithms.deployed.mla_layer import LAYER_MODES
    from .crosscheck.layer import HIDDEN, MAX_LAYER_TOKENS, layer_request
    from .invariance.dense_layer import dense_prefill_vs_decode, layer_work
    from .invariance.routing import VLLM_DECODE_THRESHOLD

    if args.stack != "all" and args.stack not in LAYER_MODES:
        raise ValueError(f"--stack: {args.stack} is a V3.2 stack; a dense model's modes are "
                         f"{', '.join(LAYER_MODES)} (or pass --model v3.2)")
    for flag, value, why in (("--topk", args.topk, "a dense layer attends to every earlier token"),
                             ("--dist", args.dist, "the dense layer draws its inputs from its own recipe"),
                             ("--max-memory", args.max_memory, "the dense layer is bounded by its work instead")):
        if value is not None:
            raise ValueError(f"{flag}: V3.2's; {why} (--model dense takes --length, --heads, --tokens, --budget, "
                             "--decode-batch and --seed)")
    args.budget = 8192 if args.budget is None else args.budget
    if args.heads > 128:
        raise ValueError(f"--heads: a layer holds at most 128 query heads, got {args.heads}")
    if args.length > MAX_LAYER_TOKENS:
        raise ValueError(f"--length: at most {MAX_LAYER_TOKENS} tokens, got {args.length}")
    tokens = None if args.tokens is None else [t if t >= 0 else args.length + t for t in args.tokens]
    if tokens is not None and (not all(0 <= t < args.length for t in tokens) or len(set(tokens)) != len(tokens)):
        raise ValueError(f"--tokens: expected distinct positions in 0..{args.length - 1} (or -1 for the last), got "
                         f"{args.tokens}")
    modes = list(LAYER_MODES) if args.stack == "all" else [args.stack]
    todo = tokens or list(range(max(0, args.length - 4), args.length))
    from .engine import get_engine

    limit = _DENSE_WORK * (4 if get_engine() == "numba" else 1)  # numba runs the layer's models about 4x as fast
    for name in modes:
        work = layer_work(name, args.length, heads=args.heads, tokens=todo, budget=args.budget,
                          decode_batch=args.decode_batch)
        if work > limit:
            raise ValueError(f"--length, --heads, --tokens: {name} runs {work:.3g} (key, head) products, over the "
                             f"{limit:.0e} a CPU runs in a few minutes on the {get_engine()} engine; ask for a "
                             "shorter request" + (" (AMLA_SIM_ENGINE=numba runs 4x as many)"
                                                  if get_engine() == "numpy" else ""))
    # o_proj's weight: only vLLM's default mode runs two kernels for it (FlashInfer's below 32 rows, DeepGEMM from 32)
    two_kernels = any(LAYER_MODES[m].engine == "vllm" and not LAYER_MODES[m].deterministic for m in modes)
    x = layer_request(args.length, heads=args.heads, seed=args.seed, hidden=HIDDEN if two_kernels else None)
    reports = [dense_prefill_vs_decode(x, m, tokens=tokens, budget=args.budget, decode_batch=args.decode_batch)
               for m in modes]
    tried = []  # what would make them equal: the engine's deterministic mode, then (vLLM) chunks it absorbs
    if args.stack != "all" and not all(v.identical for v in reports[0].tokens):
        mode = LAYER_MODES[args.stack]
        other = mode if mode.deterministic else next(m for m in LAYER_MODES.values()
                                                     if m.engine == mode.engine and m.deterministic)
        budgets = ([args.budget] if other is not mode else []) + (
            [VLLM_DECODE_THRESHOLD] if mode.engine == "vllm" and args.budget > VLLM_DECODE_THRESHOLD else [])
        for budget in budgets:
            tried.append((other.name, budget))
            reports.append(dense_prefill_vs_decode(x, other, tokens=tokens, budget=budget,
                                                   decode_batch=args.decode_batch))
            if all(v.identical for v in reports[-1].tokens):
                break
    if args.json:
        print(dumps_strict([{"mode": r.mode.name, "chunks": [vars(c) for c in r.chunks], "tokens": [
            {**dataclasses.asdict(v), "identical": v.identical} for v in r.tokens]} for r in reports], indent=2))
    else:
        text = [r.format() for r in reports]
        for j, (name, budget) in enumerate(tried, start=len(modes)):
            text[j] = (f"What would make them equal? Tried the same request in {name}" + (
                f" with a budget of {budget} (every chunk absorbed)" if budget != args.budget else "") + ":\n"
                + text[j])
        print("\n".join(text))
    asked = [v for r in reports[:len(modes)] for v in r.tokens]
    if not all(v.identical for v in asked):
        return 3
    return 5 if any(v.unmodelled for v in asked) else 0


def _add_prefill_decode(sub: argparse._SubParsersAction) -> None:
    from .algorithms.deployed.mla_layer import LAYER_MODES
    from .invariance.prefill_decode import STACKS

    p = sub.add_parser("prefill-decode", help="does a token's prefill give the bits of its decode, per serving "
                                              "stack, and why not (V3.2's sparse attention, or a dense MLA layer)",
                       description="A request's tokens (each with its top-k list of its prefix) through a serving "
                                   "stack's prefill launch and, token by token, its decode launches, on the models "
                                   "of the kernels each stack runs on Hopper with a BF16 cache: which output and "
                                   "LSE bits differ and why (two kernels, or one kernel's split plan). With "
                                   "--model dense, a dense MLA layer (DeepSeek-V3/R1, Kimi-K2) from its attention "
                                   "inputs to the output o_proj reads, the prompt prefilled in the chunks the "
                                   "engine schedules: where prefill and decode part (the form, W_UK, the kernel's "
                                   "splits, W_UV). Exit status: 0 every token identical, 3 bits differ, 4 the bits "
                                   "agree but hold NaN (no answer), 5 they agree but a piece is not device-checked "
                                   "(named), 1 or 2 an error.")
    p.add_argument("--model", default="v3.2", choices=["v3.2", "dense"],
                   help="v3.2: DeepSeek V3.2's sparse attention (default); dense: a dense MLA layer")
    p.add_argument("--stack", default="all", choices=["all", *STACKS, *LAYER_MODES],
                   help="; ".join(f"{s.name}: {s.what}" for s in STACKS.values()) + "; with --model dense: "
                   + "; ".join(f"{m.name}: {m.what}" for m in LAYER_MODES.values()))
    p.add_argument("--budget", type=_int_at_least(1),
                   help="--model dense: the scheduler's token budget (vLLM max_num_batched_tokens, SGLang "
                        "--chunked-prefill-size; default 8192)")
    p.add_argument("--length", type=_int_at_least(1), default=400,
                   help="the request's tokens (V3.2: prefilled at once; dense: in the chunks its engine schedules)")
    p.add_argument("--heads", type=_int_at_least(1), default=16, help="query heads a GPU holds (V3.2: 128 / TP)")
    p.add_argument("--topk", type=_int_at_least(128), help="the indexer's list length (V3.2: 2048, the default)")
    p.add_argument("--tokens", type=_csv(int), help="positions whose decode to compare (default: the last 4; "
                                                    "-1 is the last)")
    p.add_argument("--decode-batch", type=_int_at_least(1), default=1,
                   help="tokens in each decode launch (the token and batchmates with lists as long)")
    p.add_argument("--dist", help="V3.2: the inputs' distribution (default normal:1)")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--max-memory", type=_positive_float, metavar="GIB",
                   help="memory the models may use (default: what this machine has free)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_prefill_decode)


def _cmd_route(args: argparse.Namespace) -> int:
    """Each request's prefill, step by step: the path its chunks take and why, and what its batchmates change."""
    from .invariance.routing import alone, batchmates_change, parse_requests, route

    requests = parse_requests(args.requests)
    flag = {"vllm": "fp8_prefill", "sglang": "fp8_cache"}[args.engine]
    settings = {"budget": args.budget, "deterministic": args.deterministic, flag: args.kv_dtype == "fp8_e4m3"}
    chunks = route(args.engine, requests, **settings)
    changed = batchmates_change(args.engine, requests, **settings)
    if args.json:
        print(dumps_strict({"engine": args.engine, "settings": settings, "chunks": [vars(c) for c in chunks],
                            "batchmates_change": {str(k): v for k, v in changed.items()},
                            "alone": {str(i): [vars(c) for c in alone(args.engine, requests, i, **settings)]
                                      for i in changed}}, indent=2))
        return 0
    budget = "max_num_batched_tokens" if args.engine == "vllm" else "--chunked-prefill-size"
    print(f"{args.engine}: {len(requests)} request(s), a step's budget {args.budget} new tokens ({budget})"
          + (", deterministic" if args.deterministic else "") + f", KV cache {args.kv_dtype}")
    for c in chunks:
        print(f"  step {c.step}  request {c.request}  tokens {c.context}..{c.context + c.tokens - 1}  {c.path}\n"
              f"      kernel: {c.kernels}\n      why: {c.why}\n      projections: {c.linear}")
    for i in range(len(requests)):
        if i in changed:
            lin = "projections" in changed[i]  # the projections' kernel only where the batchmates change it
            solo = "; ".join(f"{c.context}..{c.context + c.tokens - 1} {c.path}"
                             + (f", projections: {c.linear}" if lin else "")
                             for c in alone(args.engine, requests, i, **settings))
            print(f"  request {i}: its batchmates change {changed[i]} (alone: {solo})")
        elif len(requests) > 1:
            print(f"  request {i}: the same route alone")
    return 0


def _add_route(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="which kernel computes each request's prefill (vLLM, SGLang), and whether its "
                                     "batchmates change it",
                       description="A batch of dense-MLA requests (DeepSeek-V3/R1, Kimi-K2) through an engine's "
                                   "chunked-prefill scheduler on Hopper: each step's chunk of each request, the "
                                   "attention it runs (MHA: FA3's 192/128 prefill, context merged; absorbed: FA3's "
                                   "MLA decode kernel), why (the threshold that decided it), and each request's "
                                   "route alone beside it where its batchmates change it.")
    p.add_argument("--engine", default="vllm", choices=["vllm", "sglang"])
    p.add_argument("--requests", required=True, metavar="N|C+N,...",
                   help="the batch in arrival order: N new tokens, or C+N with C already cached")
    p.add_argument("--budget", type=_int_at_least(1), default=8192,
                   help="new tokens a step (vLLM: max_num_batched_tokens; SGLang: --chunked-prefill-size)")
    p.add_argument("--deterministic", action="store_true",
                   help="vLLM: VLLM_BATCH_INVARIANT; SGLang: --enable-deterministic-inference")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="the KV cache (vLLM: with FP8, the MHA calls in E4M3 as its FP8 prefill runs them)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_route)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command."""
    parser = argparse.ArgumentParser(
        prog="amla-sim",
        description="Bit-exact simulator of low-precision MLA attention kernels (AMLA, SnapMLA, ETAP, FlashMLA).",
    )
    parser.add_argument("--version", action="version", version=f"amla-sim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_lemma, _add_run, _add_crosscheck, _add_compare, _add_invariance, _add_diff, _add_prefill_decode,
                _add_route, _add_reproduce, _add_sweep, _add_pipeline, _add_roofline):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``amla-sim`` console script.

    Exit codes: 0 success (``compare``, ``crosscheck`` and ``diff``: every stage compared and bit-identical;
    ``invariance``: no launch changed a bit); 2 a usage error (bad arguments, a request that will not fit); 1 a
    failure (a damaged or locked results folder, an unreadable file, a broken plugin's run, no GPU, out of
    memory); 3 ``compare``, ``crosscheck`` and ``diff``: bits differ, ``invariance``: a launch changed the
    request's bits; 4 ``compare``, ``crosscheck`` and ``diff``: no compared bit differs but a stage was not
    compared; 130 interrupted.
    Never a traceback for any of these.
    """
    from .experiments.store import StoreLocked

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_usage(sys.stderr)
        parser.exit(2, "amla-sim: error: a command is required (amla-sim --help lists them)\n")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("default", category=UserWarning)  # notes for the user, on stderr
            warnings.showwarning = _show_warning
            code = int(args.func(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader (head, less) went away: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        parser.exit(130, "amla-sim: interrupted\n")
    except (DataError, StoreLocked, RuntimeError, OSError) as e:
        parser.exit(1, f"amla-sim: error: {_oserror_text(e)}\n")
    except MemoryError:
        lower = {"run": "; lower --context, --heads, --batch or --sq", "sweep": "; lower --contexts or --heads",
                 "reproduce": "; lower --context or --heads"}.get(args.command, "")
        parser.exit(1, f"amla-sim: error: out of memory{lower}\n")
    except (ValueError, TypeError) as e:  # bad input: a clear message, no traceback
        parser.exit(2, f"amla-sim: error: {e}\n")


def _oserror_text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"amla-sim: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
