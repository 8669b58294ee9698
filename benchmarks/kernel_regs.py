"""Registers and spills of our Triton kernels on Hopper, without a GPU.

Compiles each kernel for sm_90 with Triton (no device needed), assembles the PTX with the ptxas
that ships inside the triton wheel (`ptxas-blackwell`: new enough for Triton's PTX version) with
`-v`, and reports registers per thread, spill stores / loads (bytes per thread) and shared memory
per config. A spilling config is usually slow on the GPU, so this screens configs offline before a
device run spends time on them.

    python benchmarks/kernel_regs.py                     # every kernel, its config table
    python benchmarks/kernel_regs.py --kernel attention  # one kernel
    python benchmarks/kernel_regs.py --json out.json
    python benchmarks/kernel_regs.py --kernel moe --sass  # + the main loop's SASS instruction mix

--sass disassembles the cubin (cuobjdump from the triton wheel) and counts the instructions of
the longest backward-branch loop by class: for a weight-streaming decode loop that is
issue-bound on the H200 (the grouped FP4 MoE kernels), instructions per iteration is an offline
proxy of speed (e.g. the grouped FP4 gate/up loop once spent spends ~12.7 instructions per weight
byte, 5.8 of them integer decode, and 16 barriers per iteration converting the activation pairs
through shared memory).

The H200 runs Triton 3.6, this machine a newer one. To compile with the GPU's Triton offline
(it has rejected code the newer one takes, e.g. a nested tuple target):

    pip download triton==3.6.0 --no-deps -d /tmp/t36
    python -m venv --system-site-packages /tmp/v36 && /tmp/v36/bin/pip install --no-deps /tmp/t36/*.whl
    /tmp/v36/bin/python benchmarks/kernel_regs.py --kernel fp8
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def ptxas_path() -> str:
    d = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    raise SystemExit(f"no ptxas under {d}")


_MULTIPLES_OF_16 = {"K", "N", "D", "I", "K_PER_SPLIT"}


def loop_mix(cubin: bytes) -> dict:
    """SASS instruction classes of the longest loop (backward branch) of a cubin: {'loop': n,
    'int', 'fp', 'cvt', 'mem_global', 'mem_shared', 'bar', 'shfl', 'mma', 'other'}."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loop = None
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            if loop is None or addr - lo > loop[1] - loop[0]:
                loop = (lo, addr)
    if loop is None:
        return {"loop": 0}
    classes = {"int": ("LOP3", "IMAD", "IADD3", "SHF", "PRMT", "LEA", "ISETP", "SEL", "IMNMX",
                       "UIADD3", "ULOP3", "UIMAD", "MOV", "CS2R", "UMOV", "IABS", "POPC"),
               "fp": ("FFMA", "FMUL", "FADD", "FSETP", "FMNMX", "FSEL", "HFMA2", "HMUL2",
                      "HADD2"),
               "cvt": ("F2F", "I2F", "F2I", "F2FP"), "mem_global": ("LDG", "STG", "LDGSTS",
                                                              "UTMALDG", "ATOMG", "RED"),
               "mem_shared": ("LDS", "STS", "STSM", "LDSM"), "bar": ("BAR", "SYNCS"),
               "shfl": ("SHFL",), "mma": ("HMMA", "HGMMA", "WARPGROUP")}
    out = {"loop": 0, **{k: 0 for k in classes}, "other": 0}
    for addr, text in ins:
        if loop[0] <= addr <= loop[1]:
            opcode = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]      # predicate dropped
            op = opcode.split(".")[0]
            out["loop"] += 1
            # HADD2.F32 is the fp16 -> fp32 conversion
            kind = "cvt" if opcode.startswith("HADD2.F32") else next(
                (k for k, ops in classes.items() if op in ops), "other")
            out[kind] += 1
    return out


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
              maxnreg: int | None = None, arch: int = 90, aligned=(), sass: bool = False) -> dict:
    """{'regs', 'spill_stores', 'spill_loads', 'smem'} of `fn` compiled for sm_<arch>.

    aligned: argument names the JIT would specialise as divisible by 16 at the real shapes
    (16-byte aligned pointers, integer args that are multiples of 16). Without it Triton cannot
    prove contiguity / alignment of computed addresses and emits narrower loads than on the GPU
    (and no cp.async pipelining). Empty: pointers, strides and the model widths in
    _MULTIPLES_OF_16."""
    constexprs = dict(constexprs)
    sig = dict(signature)
    for prm in fn.params:         # constexprs left out take their defaults (Triton wants all)
        if prm.name in constexprs or prm.name in sig or prm.default is inspect.Parameter.empty:
            continue
        if prm.is_constexpr or prm.default is None:   # None: the launcher specialises it away
            constexprs[prm.name] = prm.default
        elif isinstance(prm.default, int):            # an optional runtime integer
            sig[prm.name] = "i32"
    sig.update({k: "constexpr" for k in constexprs})
    if not aligned:   # default: what the launcher's specialisation gives at V4 widths
        aligned = [n for n, t in signature.items() if t.startswith("*") or n.startswith("stride")
                   or n.endswith("page_bytes") or n in _MULTIPLES_OF_16]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    try:
        out = subprocess.run([ptxas_path(), "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    txt = out.stdout + out.stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, txt)) else None  # noqa: E731
    if num(r"Used (\d+) registers") is None:
        raise RuntimeError(f"ptxas: {txt[-400:]}")
    res = {"regs": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
           "spill_loads": num(r"(\d+) bytes spill loads"), "smem": k.metadata.shared}
    if sass:
        res["sass_loop"] = loop_mix(k.asm["cubin"])
    return res


# ---- the kernels and their config tables --------------------------------------------------------
def _moe_cases():
    import dspark.kernels.fp4_moe as fm
    common = {"idx_ptr": "*i64", "emap_ptr": "*i32", "w_ptr": "*i8", "stride_we": "i64",
              "stride_wn": "i32", "s_ptr": "*u8", "stride_se": "i64", "stride_sn": "i32"}
    up = {"x_ptr": "*bf16", "stride_xt": "i32", "idx_ptr": "*i64", "rw_ptr": "*fp32",
          "emap_ptr": "*i32", **common, "h_ptr": "*bf16", "stride_hp": "i32", "KSLOTS": "i32",
          "I": "i32", "D": "i32", "limit": "fp32", "NP": "i32"}
    down = {"h_ptr": "*bf16", "stride_hp": "i32", "idx_ptr": "*i64", "emap_ptr": "*i32", **common,
            "out_ptr": "*bf16", "stride_ot": "i32", "KSLOTS": "i32", "D": "i32", "I": "i32",
            "NP": "i32", "add_ptr": "*bf16", "stride_at": "i32"}
    for fn, sig in ((fm._fp4_moe_gate_up_kernel, up), (fm._fp4_moe_down_kernel, down)):
        # the down kernel as QuantMoE runs it: the shared expert added, bf16 out
        extra = {"HAS_ADD": True, "OUT_DT": "bf16"} if sig is down else {}
        for n, g, w, st in fm._GEMV_CONFIGS:
            yield (fn.__name__, f"BLOCK_N={n} BLOCK_G={g} warps={w} stages={st}", fn, sig,
                   {"BLOCK_N": n, "BLOCK_G": g, "DT": "bf16", "BF16_PAIRS": True,
                    "PAIR_DECODE": True, "FULL_GROUPS": True, **extra}, w, st, None)
        yield (fn.__name__, "BLOCK_N=4 BLOCK_G=32 warps=4", fn,      # the shipped blocks
               sig, {"BLOCK_N": 4, "BLOCK_G": 32, "DT": "bf16", "BF16_PAIRS": True,
                     "PAIR_DECODE": True, "FULL_GROUPS": True, **extra},
               4, 3, None)
    import dspark.kernels.fp4_moe_mma as mm       # expert-grouped tensor-core kernels
    mcommon = {"table_ptr": "*i32", "bexp_ptr": "*i32", "emap_ptr": "*i32", "w_ptr": "*u8",
               "stride_we": "i32", "stride_wn": "i32", "s_ptr": "*u8", "stride_se": "i32",
               "stride_sn": "i32"}
    mup = {"x_ptr": "*bf16", "stride_xt": "i32", "table_ptr": "*i32", "bexp_ptr": "*i32",
           "rw_ptr": "*fp32", **mcommon, "h_ptr": "*bf16", "stride_hp": "i32", "KSLOTS": "i32",
           "I": "i32", "D": "i32", "limit": "fp32"}
    mdown = {"h_ptr": "*bf16", "stride_hp": "i32", **mcommon, "ws_ptr": "*fp32",
             "stride_wsp": "i32", "D": "i32", "I": "i32"}
    for fn, sig in ((mm._mma_gate_up_kernel, mup), (mm._mma_down_kernel, mdown)):
        for n, bk, w, st in ((32, 256, 4, 3), (64, 256, 4, 3), (32, 256, 4, 4)):
            yield (fn.__name__, f"BLOCK_N={n} BLOCK_K={bk} warps={w} stages={st}", fn, sig,
                   {"BLOCK_N": n, "BLOCK_K": bk, "BLOCK_T": mm.BLOCK_T, "DT": "bf16"}, w, st, None)


def _fp8_cases():
    import dspark.kernels.fp8_gemm as fg
    sig = {"x_ptr": "*bf16", "stride_xt": "i32", "w_ptr": "*u8", "stride_wn": "i32", "s_ptr": "*u8",
           "stride_sn": "i32", "y_ptr": "*fp32", "stride_ys": "i32", "stride_yt": "i32", "T": "i32",
           "N": "i32", "K": "i32", "K_PER_SPLIT": "i32"}
    for bm, bn in ((16, 64), (64, 128), (128, 128)):
        yield ("_fp8_linear_kernel", f"BLOCK_M={bm} BLOCK_N={bn}", fg._fp8_linear_kernel, sig,
               {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": fg.FP8_BLOCK, "PRECISION": "bf16"}, 4, 3,
               None)
    ssig = {"x_ptr": "*bf16", "stride_xt": "i32", "stride_xg": "i32", "w_ptr": "*u8",
            "stride_wn": "i32", "s_ptr": "*u8", "stride_sn": "i32", "y_ptr": "*bf16",
            "stride_yt": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "T": "i32", "N": "i32",
            "K": "i32", "K_PER_SPLIT": "i32", "GROUP_ROWS": "i32"}
    for bn, bt, split in ((64, 16, 1), (64, 16, 8), (128, 16, 4), (64, 64, 1)):
        yield ("_fp8_skinny_kernel", f"BLOCK_N={bn} BLOCK_T={bt} SPLIT={split} warps=4",
               fg._fp8_skinny_kernel, ssig, {"BLOCK_N": bn, "BLOCK_T": bt, "BLOCK_K": fg.FP8_BLOCK,
                                             "PRECISION": "bf16", "SPLIT": split}, 4, 3, None)
    for split in (1, 8):      # the default for bf16 x: fp16 operands (+ the unpipelined rescue)
        yield ("_fp8_skinny_kernel", f"BLOCK_N=64 BLOCK_T=16 SPLIT={split} warps=4 fp16",
               fg._fp8_skinny_kernel, ssig, {"BLOCK_N": 64, "BLOCK_T": 16, "BLOCK_K": fg.FP8_BLOCK,
                                             "PRECISION": "fp16", "SPLIT": split}, 4, 3, None)
    hsig = dict(ssig, w_ptr="*bf16", s_ptr="*bf16", y_ptr="*fp32", key_ptr="*i32",
                idx_ptr="*i32")                   # the vocabulary head + its chunk argmax
    yield ("_fp8_skinny_kernel", "BLOCK_N=64 BLOCK_T=16 SPLIT=1 warps=4 W16 head argmax",
           fg._fp8_skinny_kernel, hsig, {"BLOCK_N": 64, "BLOCK_T": 16, "BLOCK_K": fg.FP8_BLOCK,
                                         "PRECISION": "bf16", "SPLIT": 1, "W16": True}, 4, 3, None)
    import dspark.kernels.fp8_gemv_tc as tc       # the tensor-core GEMV of 1-16 tokens
    gsig = dict(ssig, KCH="i32")
    del gsig["K_PER_SPLIT"]
    for nt, u, split, pre in ((1, 1, 1, False), (1, 1, 8, False), (1, 2, 8, False),
                              (2, 1, 4, False), (1, 1, 8, True), (2, 1, 4, True)):
        yield ("_fp8_gemv_tc_kernel", f"NT={nt} UNROLL={u} SPLIT={split} warps=1"
               + (" PDL preload" if pre else ""), tc._fp8_gemv_tc_kernel, gsig,
               dict(tc._launch_strings(nt, u), SPLIT=split, WARPS=1, NT=nt, UNROLL=u, PDL=pre,
                    PRELOAD=pre), 1, 1, None)


def _attention_cases():
    lst = lambda p: {f"{p}_u8_ptr": "*u8", f"{p}_bf16_ptr": "*bf16", f"{p}_page_bytes": "i32",  # noqa: E731
                     f"{p}_N": "i32", f"{p}_idx_ptr": "*i32", f"{p}_stride_it": "i32",
                     f"{p}_K": "i32", f"{p}_len_ptr": "*i32"}
    sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "out_ptr": "*fp32",
           "stride_ot": "i32", "stride_oh": "i32", "part_ptr": "*fp32", "lse_ptr": "*fp32",
           "sink_ptr": "*fp32", "H": "i32", "qk_scale_log2": "fp32", **lst("a"), **lst("b")}
    # V4-Flash shapes: every pointer 16-byte aligned, every integer argument a multiple of 16
    # (page_bytes = 64 x 584, N = 64, H = 64, K = 128 / 512, strides): the JIT specialises them
    aligned = [a for a, ty in sig.items() if ty != "fp32"]
    # v3 (dspark/kernels/sparse_mqa_v3.py): log2 of each list's N next to it (power-of-two N)
    import dspark.kernels.sparse_mqa_v3 as v3
    sig3 = {}
    for k, v in sig.items():
        sig3[k] = v
        if k in ("a_N", "b_N"):
            sig3[k[0] + "_shift"] = "i32"
    for bk, w, st, mr, *extra in V3_CONFIGS:
        extra = extra[0] if extra else {}
        const = {"FP8": True, "HAS_B": True, "A_HAS_LEN": True, "B_HAS_LEN": True,
                 "POW2_N": True, "BLOCK_H": 64, "BLOCK_N": bk, "NUM_SPLITS": 1,
                 "PRECISION": "bf16", "EARLY": bool(extra.get("early_decode"))}
        yield ("_sparse_mqa_v3_kernel", f"block_k={bk} num_warps={w} num_stages={st}"
               + (f" maxnreg={mr}" if mr else "")
               + "".join(f" {k}={v}" for k, v in extra.items()),
               v3._sparse_mqa_v3_kernel, sig3, const, w, st, mr, aligned)


# v3 configs screened offline: (block_k, num_warps, num_stages, maxnreg[, v3 knobs])
_EARLY = dict(early_decode=True)
V3_CONFIGS = [(64, 8, 1, None), (64, 8, 2, None), (32, 8, 1, None), (32, 8, 2, None),
              (32, 8, 3, None), (16, 8, 2, None), (16, 8, 3, None), (64, 8, 3, None),
              (128, 8, 1, None), (64, 8, 2, None, _EARLY), (64, 8, 3, None, _EARLY),
              (32, 8, 2, None, _EARLY)]


def _decode_fused_cases():
    import dspark.kernels.decode_fused as df     # the small fused decode kernels
    sw = {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*fp32",
          "idx_ptr": "*i64", "N": "i32", "stride_g": "i32", "stride_u": "i32", "limit": "fp32",
          "GROUP": "i32", "G": "i32"}
    for block in (1024, 512):
        yield ("_swiglu_kernel", f"BLOCK={block} warps=4", df._swiglu_kernel, sw,
               {"DT": "bf16", "EXACT": True, "BLOCK": block}, 4, 1, None)
    yield ("_swiglu_kernel", "BLOCK=1024 warps=4 (expert, weight) pairs K=2", df._swiglu_kernel,
           sw, {"DT": "bf16", "EXACT": True, "BLOCK": 1024, "HAS_W": True, "K": 2}, 4, 1, None)
    gp = {"ring_a_ptr": "*fp32", "ring_z_ptr": "*fp32", "a_ptr": "*fp32", "z_ptr": "*fp32",
          "stride_ra": "i32", "stride_rz": "i32", "stride_a": "i32", "stride_z": "i32",
          "from_ring_ptr": "*u8", "ring_rows_ptr": "*i64", "fresh_rows_ptr": "*i64",
          "before_zero_ptr": "*u8", "valid_ptr": "*u8", "out_ptr": "*fp32", "ape_ptr": "*fp32",
          "stride_ape": "i32", "pos_ptr": "*i64", "persist_ptr": "*i64", "E": "i32", "S": "i32",
          "M": "i32", "D": "i32"}
    for bs in (8, 16, 128):                     # ratio 4 (overlap: 8 slots), 16, 128
        bd = df._pool_block_d(bs, 512)
        yield ("_gather_pool_kernel", f"BLOCK_S={bs} BLOCK_D={bd} warps=4",
               df._gather_pool_kernel, gp, {"BLOCK_S": bs, "BLOCK_D": bd, "EXACT": True,
                                            "APE": True, "C": 2 if bs == 8 else 1}, 4, 1, None)
    hf = {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32", "stride_x": "i32",
          "inv_sqrt": "fp32", "amax_floor": "fp32"}
    rt = {"logits_ptr": "*fp32", "stride_l": "i32", "bias_ptr": "*fp32", "tid_ptr": "*i64",
          "stride_tid": "i32", "tok_ptr": "*i64", "idx_ptr": "*i64", "w_ptr": "*fp32", "E": "i32",
          "route_scale": "fp32"}
    for hashed in (False, True):                # V4-Flash: 256 experts, 6 per token
        yield ("_route_kernel", f"E=256 K=6 HASH={hashed} warps=4", df._route_kernel, rt,
               {"K": 6, "HASH": hashed, "EXACT": True, "BLOCK_E": 256, "BLOCK_K": 8}, 4, 1, None)
    cr = {"pool_ptr": "*u8", "page_bytes": "i64", "split_ptr": "*i64", "n": "i32",
          "per_page": "i32"}
    yield ("_copy_records_kernel", "DATA=576 SCALE=8 warps=4", df._copy_records_kernel, cr,
           {"DATA": 576, "SCALE": 8, "BLOCK": 1024, "BLOCK_S": 8}, 4, 1, None)
    yield ("_hadamard_fp4_kernel", "BLOCK_R=16 warps=4", df._hadamard_fp4_kernel, hf,
           {"BLOCK_R": 16, "DIM": 128, "FP4_BLOCK": 32}, 4, 1, None)
    import dspark.kernels.mhc as mhc             # hc_post with the next collapse's partials
    po = {"o_ptr": "*bf16", "x_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
          "out_ptr": "*bf16", "fn_ptr": "*fp32", "part_ptr": "*fp32", "sq_ptr": "*fp32",
          "T": "i32", "D": "i32", "R": "i32", "ids_ptr": "*i64", "base_ptr": "*fp32",
          "scale_ptr": "*fp32", "u_ptr": "*bf16", "nw_ptr": "*bf16", "cnt_ptr": "*i32",
          "S": "i32", "norm_eps": "fp32", "hc_eps": "fp32", "rms_eps": "fp32"}
    yield ("_post", "N=4 BLOCK_D=64 NEXT R=24 warps=4", mhc._post, po,
           {"N": 4, "BLOCK_N": 4, "BLOCK_D": 64, "OUT_BF16": True, "NEXT": True, "BLOCK_R": 32},
           4, 1, None)
    yield ("_post", "N=4 BLOCK_D=64 NEXT R=24 FINISH (+ GATHER, PDL) warps=8", mhc._post, po,
           {"N": 4, "BLOCK_N": 4, "BLOCK_D": 64, "OUT_BF16": True, "NEXT": True, "BLOCK_R": 32,
            "FINISH": True, "BLOCK_S": 64, "BLOCK_DF": 4096, "GATHER": True, "EXPAND": True,
            "PDL": True}, 8, 1, None)
    fp = {"x_ptr": "*bf16", "part_ptr": "*fp32", "sq_ptr": "*fp32", "base_ptr": "*fp32",
          "scale_ptr": "*fp32", "u_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
          "T": "i32", "D": "i32", "S": "i32", "K": "i32", "norm_eps": "fp32", "hc_eps": "fp32",
          "sinkhorn_iters": "i32", "nw_ptr": "*bf16", "rms_eps": "fp32"}
    yield ("_finish_pre", "N=4 S=64 D=4096 NORM warps=8 (the decode u + RMSNorm launch)",
           mhc._finish_pre, fp, {"N": 4, "BLOCK_N": 4, "BLOCK_S": 64, "BLOCK_R": 32,
                                 "BLOCK_D": 4096, "HEAD": True, "OUT_BF16": True, "U": True,
                                 "NORM": True}, 8, 1, None)


def _markov_loop_cases():
    import dspark.kernels.markov_loop as ml       # the drafter's Markov loop, one program a row
    sig = {"base_ptr": "*fp32", "stride_b_r": "i32", "stride_b_k": "i32", "anchor_ptr": "*i64",
           "w1_ptr": "*bf16", "stride_w1": "i32", "w2_ptr": "*bf16", "stride_w2": "i32",
           "hid_ptr": "*bf16", "stride_h_r": "i32", "stride_h_k": "i32", "wc_ptr": "*bf16",
           "temp_ptr": "*fp32", "u_ptr": "*fp32", "stride_u_r": "i32", "tok_ptr": "*i64",
           "q_ptr": "*fp32", "conf_ptr": "*fp32", "V": "i32", "RANK": "i32", "D": "i32",
           "G": "i32"}
    # unit strides, as the launcher specialises them
    unit = {n: 1 for n in ("stride_b_v", "stride_a", "stride_h_d", "stride_wc", "stride_t",
                           "stride_u_k")}
    for V, rank, D in ((512, 64, 192), (4096, 64, 192), (1024, 256, 512), (512, 0, 192)):
        bv, br = ml._blocks(V, rank)
        for greedy in (True, False):
            yield ("_markov_loop_kernel", f"V={V} r={rank} BLOCK_V={bv} GREEDY={greedy} warps=4",
                   ml._markov_loop_kernel, sig,
                   {**unit, "GREEDY": greedy, "BLOCK_V": bv, "BLOCK_R": br,
                    "BLOCK_D": triton.next_power_of_2(D)}, 4, 1, None)


def _draft_attention_cases():
    import dspark.kernels.draft_attention as da    # the drafter stages' block attention
    sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "ring_ptr": "*bf16",
           "stride_rs": "i32", "stride_rj": "i32", "slots_ptr": "*i64", "rpos_ptr": "*i64",
           "stride_ps": "i32", "starts_ptr": "*i64", "blk_ptr": "*bf16", "stride_bt": "i32",
           "sink_ptr": "*fp32", "cis_ptr": "*fp32", "out_ptr": "*bf16", "stride_ot": "i32",
           "stride_oh": "i32", "H": "i32", "D": "i32", "CAP": "i32", "W": "i32",
           "scale_log2": "fp32", "R_HALF": "i32"}
    # the shipped drafter: γ = 5, 4 heads of 512, a 128-entry ring; the launch's config first
    for warps, stages in ((da.NUM_WARPS, da.NUM_STAGES), (8, 2), (4, 1)):
        yield ("_draft_attention_kernel", f"D=512 G=5 bf16 split ROPE warps={warps} "
               f"stages={stages}", da._draft_attention_kernel, sig,
               {"G": 5, "BLOCK_D": 512, "BLOCK_G": 16, "BLOCK_M": da.BLOCK_M,
                "BLOCK_N": da.BLOCK_N, "SPLIT": True, "BF16": True, "ROPE": True, "ROUND": 1},
               warps, stages, None)


KERNELS = {"moe": _moe_cases, "fp8": _fp8_cases, "attention": _attention_cases,
           "decode_fused": _decode_fused_cases, "markov_loop": _markov_loop_cases,
           "draft_attention": _draft_attention_cases}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=sorted(KERNELS), action="append",
                    help="which kernels (default: all)")
    ap.add_argument("--match", default=None,
                    help="only rows whose 'kernel config' text contains this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sass", action="store_true",
                    help="also the main loop's SASS instruction mix (see the module doc)")
    a = ap.parse_args(argv)
    rows = []
    print(f"{'kernel':<26} {'config':<58} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'smem KB':>8}")
    for name in a.kernel or sorted(KERNELS):
        for kname, label, fn, sig, const, warps, stages, maxnreg, *aligned in KERNELS[name]():
            if a.match and a.match not in f"{kname} {label}":
                continue
            try:
                r = resources(fn, sig, const, warps, stages, maxnreg,
                              aligned=aligned[0] if aligned else (), sass=a.sass)
            except Exception as e:          # report and go on: one bad config is a finding too
                r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            rows.append({"kernel": kname, "config": label, **r})
            if "error" in r:
                print(f"{kname:<26} {label[:58]:<58} {r['error']}")
            else:
                print(f"{kname:<26} {label[:58]:<58} {r['regs']:>5} {r['spill_stores'] or 0:>9} "
                      f"{r['spill_loads'] or 0:>9} {r['smem'] / 1024:>8.1f}", flush=True)
                if a.sass:
                    print("    loop: " + ", ".join(f"{k} {v}" for k, v in r["sass_loop"].items()
                                                 if v), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"arch": "sm_90a", "triton": triton.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
