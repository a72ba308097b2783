//! The decode GEMV (`decode.cu`): the fused backend's form for a Linear layer over a few tokens,
//! `y[m, n] = epilogue(x[m, k] · W[n, k]ᵀ)` with m at most [`DECODE_GEMV_MAX_TOKENS`].
//!
//! A decode step's matmul reads every weight once and does 2·m flops per weight element: it is memory
//! bound, and its floor is the weight's bytes over the copy bandwidth. cuDNN's matmul engines reached
//! 67-90% of that floor on an H200 at one token (issue 12). This kernel streams the weight: each warp
//! owns a few rows of W (output features), each lane keeps a few loads of 16 bytes of them in flight
//! (3 at one token, 2 over rows of [`LONG_ROWS`] elements or more), bypassing L1; x is read through
//! L1, which the warps of an SM share, once per chunk for all the warp's rows; f32 accumulation and a
//! warp-shuffle sum; the epilogue runs on the lane that writes, in f32 with one rounding, as the fused
//! graph's does. How many rows per warp and
//! loads per lane was measured in whole replayed decode steps, not per call (a call's best and the
//! step's best differ): what counts is that a projection of few rows per SM runs in one wave of
//! resident warps ([`FUSED_TILES`]).
//!
//! Tokens come in tiles of 1, 2, 4 or 8 ([`TILES`]: the kernel `gemv_<dtype>_m<tile>` for the
//! smallest tile that holds m; a tile's extra tokens repeat the last one and are not written). The
//! bound is 8: each token adds 8 FMAs per 16 bytes of W (and an x read from L1 per chunk, shared by a
//! warp's rows); by our count the FMAs at 8 tokens take about half of an H100/H200 SM's f32 rate while
//! the weight streams at copy bandwidth, so the kernel should stay memory bound up to there (the
//! `05-decode` example times m = 1, 4 and 8). Beyond, a tensor-core GEMM that reuses each weight across
//! tokens is the right kernel, and cuDNN's is.
//!
//! It takes exactly the Linear case ([`MatmulArgs::linear`], or a batch of A that folds into its rows
//! over a shared B): A row-major `[1, m, k]`, B the column-major view of a row-major weight `[n, k]`,
//! bf16 or f16 in and out (bias, U, R in the same dtype), every epilogue, k and both row strides
//! multiples of 8 elements, x and W 16-byte aligned. The launch shape depends on the shape only (no
//! host sync, no allocation), so CUDA-graph capture works. [`MatmulArgs::decode_gemv`] says why a call
//! does not qualify; [`Cudnn::kernel_runs`] lists the shapes a context ran.
//!
//! At one token it also runs the forms only it has ([`MatmulArgs::with_prologue`],
//! [`MatmulArgs::with_up_product`]): `gemv_<dtype>_m1_norm` (the input's RMSNorm in the projection's
//! launch: `rsqrt(mean(x²) + ε)` is a scalar of the token, so each warp sums `W · (x ∘ norm_w)` as it
//! streams W, sums x² over the chunks it reads on the way, and scales its sums at the end: nothing
//! before W streams, and no normalized row in memory), `gemv_<dtype>_m1_dual` (SwiGLU's gate and up:
//! each warp streams the same rows of both weights) and `gemv_<dtype>_m1_norm_dual` (both); and with
//! [`MatmulArgs::with_rotary`], `gemv_<dtype>_m1_rope` and `gemv_<dtype>_m1_norm_rope` (qkv_proj
//! with RoPE and the K/V append: each warp owns a head's pair of rows `j` and `j + d/2`, so the lane
//! that writes holds both halves of the rotation; the outputs are bit-identical to the projection
//! followed by the RoPE op; where the grid has few row pairs per SM, as a tensor-parallel rank's
//! qkv_proj, they keep twice the loads in flight: `gemv_<dtype>_m1_[norm_]rope_u4`, [`Gemv::for_sms`]).
//! What they save in a decode step is launches: on an H200 the 8B step
//! with all of them took 4.134 ms against 4.196 without RoPE folded and 4.520 with nothing folded, in
//! one run (`examples/05-decode`, which times the step under every fusion).
//!
//! At one token each form also comes with a block of four warps per row group instead of a warp
//! (`gemv_<dtype>_m1[_<form>]_block`, [`GemvSplit::Block`]): a row of a few thousand elements is then
//! one round of loads per thread and the grid has several blocks per SM, for the projections with few
//! output rows per SM (qkv and o_proj), where the warp form's grid is under a wave and its warps make
//! two round trips each. Measured, it lost on those shapes, so [`GemvSplit::Auto`] keeps the warp form
//! ([`Gemv::with_split`]); [`Exec::set_gemv_split`](crate::Exec::set_gemv_split) forces the block form,
//! for A/B runs.
//!
//! On compute capability 9.0+ the GEMVs launch as programmatic dependent launches
//! ([`Exec::set_programmatic_launch`](crate::Exec::set_programmatic_launch)): a GEMV's blocks may start
//! while the kernel before it drains, prefetch their first chunks of W into L2, let the next kernel
//! launch, and wait (`griddepcontrol.wait`) before they read x or write D. A plain GEMV whose output a
//! collective reads next without waiting for it ([`MatmulOperands::before_collective`]: NCCL's
//! symmetric kernels) never lets the next kernel launch early (its `trigger` argument is 0).

use super::{Activation, Epilogue, MatmulArgs, MatmulOperands, Prologue, Rotary};
use crate::checked;
use crate::dtype::{DataType, Element};
use crate::kernels::{launch_programmatic, optional_ptr, Arg, Kernels};
use crate::{Cudnn, Error, GemvSplit, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use std::hash::{DefaultHasher, Hash, Hasher};

/// The most rows of A (tokens) the decode GEMV takes; more run the cuDNN graph.
pub const DECODE_GEMV_MAX_TOKENS: usize = 8;

/// The most tokens for which the fused backend takes the GEMV by itself ([`MatmulArgs::form`] unset);
/// up to [`DECODE_GEMV_MAX_TOKENS`] it runs when asked for. Measured on an H200 (`examples/05-decode`,
/// Llama-3.1-8B projections, L2 flushed): at 4 and 8 tokens the GEMV took 1.04-1.8x the cuDNN graph's
/// time on every projection; at one token it was within 0.86-1.06x of it per call and, in a whole
/// decode step replayed as a CUDA graph, 0.17 ms faster (4.553 vs 4.719 ms per step).
pub const DECODE_GEMV_AUTO_TOKENS: usize = 1;

/// The kernels' token tiles and the rows of W each warp owns at that tile (`GEMV_TILES` in
/// `decode.cu`; a mismatch costs speed, not correctness: warps stride over the rows).
const TILES: [(usize, usize); 4] = [(1, 1), (2, 2), (4, 2), (8, 4)];

/// The plain one-token GEMV over rows of at least `.0` elements keeps `.1` chunks of each row in flight
/// (kernel `gemv_<dtype>_m1_u<.1>`) instead of the 3 of [`TILES`]' one-token kernel. Measured in whole
/// replayed Llama-3.1-8B decode steps, 4 rounds each (`tp-bench --decode-variants`,
/// `benches/results/h200-x2/tensor-parallel.md`): a TP2 rank's down projection (k 7168) at 2 chunks
/// against 3, median step 2.7785 against 2.7916 ms back to back on two H200s, 3.4692 against 3.4781
/// on two H100s; one GPU's (k 14336) 5.5699 against 5.5812 ms on an H100. At k 2048 and 4096
/// (o_proj, lm_head) 2 chunks gained nothing or lost (a TP2 rank's o_proj 3.5846 against 3.5800 ms
/// on two H100s).
const LONG_ROWS: (usize, usize) = (7168, 2);

/// The rows of W per warp and the chunks of each row in flight of the one-token fused forms
/// (`GEMV_FUSED` in `decode.cu`). Chosen on an H200 in whole replayed 8B decode steps
/// (`benches/results/h200/decode-roofline.md`): a projection of few rows per SM wants its grid in
/// one wave (the norm form at one row and 8 chunks per warp took 80 registers, so qkv_proj's 1536
/// blocks ran in two waves; at 2 rows and 1 chunk, 768 blocks in one), and the gate-up GEMV with
/// the norm streams 2 rows of each weight per warp, 1 chunk each in flight (8B step 4.133 ms
/// against 4.255 at 1 row, in one run; what wins is not monotonic in registers or chunks, so each
/// tile here was measured in the step against its neighbours).
const FUSED_TILES: [(&str, usize, usize); 5] =
    [("norm", 2, 1), ("dual", 1, 4), ("norm_dual", 2, 1), ("rope", 2, 2), ("norm_rope", 2, 2)];

/// The chunks of each row in flight of the rotary forms (kernels `gemv_<dtype>_m1_[norm_]rope_u4`)
/// when the grid holds fewer than [`DEEP_ROPE_PAIRS_PER_SM`] row pairs (warps) per SM, as qkv_proj
/// on a tensor-parallel rank does: half the warps, so twice the loads in flight per warp keep the
/// bytes in flight per SM. Measured in whole replayed Llama-3.1-8B decode steps, 3 rounds each
/// (`benches/results/h200-x2/tensor-parallel.md`, `benches/results/h100-x2/tensor-parallel.md`): a
/// TP2 rank's qkv_proj (4096 -> 3072, 1536 pairs on 132 SMs) at 4 chunks against 2, median step
/// 2.881 against 2.931 ms on two H200s and 3.576 against 3.611 on two H100s (3 chunks in between, 1
/// slower); one GPU's (4096 -> 6144, 3072 pairs) lost at 4 (4.255 against 4.164 ms on an H200, 5.675
/// against 5.604 on an H100) and keeps 2.
const DEEP_ROPE_CHUNKS: usize = 4;

/// Row pairs per SM below which the rotary forms take [`DEEP_ROPE_CHUNKS`].
const DEEP_ROPE_PAIRS_PER_SM: usize = 16;

/// The one-token kernels with a block per row group ([`GemvSplit::Block`], `GEMV_BLOCKS` in
/// `decode.cu`): the form (`""` for the plain GEMV), rows of W (and of W_up) per block, chunks of each
/// per thread in flight.
const BLOCK_TILES: [(&str, usize, usize); 4] =
    [("", 2, 4), ("norm", 2, 4), ("dual", 1, 4), ("norm_dual", 1, 4)];

/// Threads per block (the kernels' `__launch_bounds__`).
const BLOCK: usize = 128;

/// One decode GEMV launch: the shapes and strides the kernel reads, its tile, and what the call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Gemv {
    /// Tokens (rows of x and D).
    m: usize,
    /// Inner dimension.
    k: usize,
    /// Output features (rows of W, columns of D).
    n: usize,
    /// Elements between the rows of x.
    ldx: usize,
    /// Elements between the rows of W.
    ldw: usize,
    /// The token tile of the kernel (m or more).
    tile: usize,
    /// Rows of W per warp, or per block with `block`.
    rows_per_warp: usize,
    /// A block of [`BLOCK`] threads shares each row ([`GemvSplit::Block`], one token), not a warp.
    block: bool,
    /// Dtype of x, D and the epilogue's inputs.
    dtype: DataType,
    /// W's element: `dtype`, or FP8 codes ([`DataType::F8E4M3`], [`DataType::F8E5M2`] plain only)
    /// whose factors multiply each row's sum.
    weight: DataType,
    /// The epilogue.
    epilogue: Epilogue,
    /// The prologue on x (one token).
    prologue: Option<Prologue>,
    /// The gate's multiplier is x · W_upᵀ (one token).
    dual: bool,
    /// RoPE and the K/V append after the product (one token; rows in pairs).
    rotary: Option<Rotary>,
    /// The rotary form with [`DEEP_ROPE_CHUNKS`] in flight ([`Gemv::for_sms`]).
    deep: bool,
    /// The plain GEMV never lets the next kernel start early ([`MatmulOperands::before_collective`]).
    no_trigger: bool,
}

impl Gemv {
    /// The fused form's name (`norm`, `dual` or `norm_dual`), `None` for the plain GEMV.
    fn fused_form(&self) -> Option<&'static str> {
        match (self.prologue.is_some(), self.dual, self.rotary.is_some()) {
            (false, false, false) => None,
            (true, false, false) => Some("norm"),
            (false, true, false) => Some("dual"),
            (true, true, false) => Some("norm_dual"),
            (false, _, true) => Some("rope"),
            (true, _, true) => Some("norm_rope"),
        }
    }

    /// The kernel's name, `gemv_<dtype>_m<tile>` (`gemv_<dtype>_m1_u2` over long rows, [`LONG_ROWS`]),
    /// or `gemv_<dtype>_m1_<form>` for a fused form; with a block per row group `gemv_<dtype>_m1_block`
    /// or `gemv_<dtype>_m1_<form>_block`.
    fn kernel(&self) -> String {
        let x = if self.dtype == DataType::F16 { "f16" } else { "bf16" };
        let sfx = match self.weight {
            DataType::F8E4M3 => format!("{x}_e4m3"),
            DataType::F8E5M2 => format!("{x}_e5m2"),
            _ => x.to_string(),
        };
        match (self.fused_form(), self.block) {
            (Some(form), false) if self.deep => format!("gemv_{sfx}_m1_{form}_u{DEEP_ROPE_CHUNKS}"),
            (Some(form), false) => format!("gemv_{sfx}_m1_{form}"),
            (None, false) if self.tile == 1 && self.k >= LONG_ROWS.0 => {
                format!("gemv_{sfx}_m1_u{}", LONG_ROWS.1)
            }
            (None, false) => format!("gemv_{sfx}_m{}", self.tile),
            (Some(form), true) => format!("gemv_{sfx}_m1_{form}_block"),
            (None, true) => format!("gemv_{sfx}_m1_block"),
        }
    }

    /// This launch with the split asked for ([`Exec::gemv_split`]):
    /// [`GemvSplit::Block`] applies at one token only; [`GemvSplit::Auto`] keeps the warp form: on an
    /// H200 the block form lost on the shapes it was written for (qkv 4096->6144: 0.0210 ms against
    /// 0.0190; o_proj 4096->4096 + residual: 0.0150 against 0.0137; the whole 8B decode step 5.14 ms
    /// against 4.59, `benches/results/h200/decode-roofline.md`).
    ///
    /// [`Exec::gemv_split`]: crate::Exec::gemv_split
    pub(super) fn with_split(self, split: GemvSplit) -> Gemv {
        // The rotary form has no block split (a warp owns a head's row pair), nor does a GEMV that
        // must not let the next kernel start early (the block kernels always do).
        let block = self.m == 1
            && split == GemvSplit::Block
            && self.rotary.is_none()
            && !self.no_trigger
            && self.weight == self.dtype;
        if !block {
            return Gemv { block: false, ..self };
        }
        let form = self.fused_form().unwrap_or("");
        let rows = BLOCK_TILES.iter().find(|t| t.0 == form).map_or(1, |t| t.1);
        Gemv { block: true, tile: 1, rows_per_warp: rows, ..self }
    }

    /// This launch on a GPU of `sms` multiprocessors: the rotary form with [`DEEP_ROPE_CHUNKS`] in
    /// flight when its grid has fewer than [`DEEP_ROPE_PAIRS_PER_SM`] row pairs per SM.
    pub(super) fn for_sms(self, sms: usize) -> Gemv {
        let deep = self.rotary.is_some() && !self.block && self.n / 2 < DEEP_ROPE_PAIRS_PER_SM * sms;
        Gemv { deep, ..self }
    }

    /// Blocks of [`BLOCK`] threads, one warp per `rows_per_warp` rows (or one block with `block`).
    fn config(&self) -> Result<LaunchConfig> {
        let warps = self.n.div_ceil(self.rows_per_warp);
        let blocks = if self.block { warps } else { warps.div_ceil(BLOCK / 32) };
        Ok(LaunchConfig {
            grid_dim: (checked::launch_dim("decode gemv: blocks", blocks)?, 1, 1),
            block_dim: (BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// `decode gemv [m, k] x [k, n] bf16 epilogue residual (gemv_bf16_m1)`, for reports.
    /// With a prologue or the up product: `decode gemv rms_norm(1e-5) [1, k] x [k, n] bf16 epilogue
    /// silu+gate up-product (gemv_bf16_m1_norm_dual)`.
    fn describe(&self) -> String {
        let prologue = self.prologue.map(|p| format!("{} ", p.name())).unwrap_or_default();
        let up = if self.dual { " up-product" } else { "" };
        let rope = self.rotary.map(|r| format!(" {}", r.name())).unwrap_or_default();
        format!(
            "decode gemv {prologue}[{}, {}] x [{}, {}] {}{} epilogue {}{up}{rope} ({})",
            self.m,
            self.k,
            self.k,
            self.n,
            self.dtype,
            if self.weight == self.dtype { String::new() } else { format!(" weight {}", self.weight) },
            self.epilogue,
            self.kernel()
        )
    }
}

/// The kernels' activation codes (`gemv_activation` in `decode.cu`).
fn activation_code(a: Option<Activation>) -> i64 {
    match a {
        None => 0,
        Some(Activation::Silu) => 1,
        Some(Activation::Gelu) => 2,
        Some(Activation::GeluTanh) => 3,
        Some(Activation::Relu) => 4,
    }
}

impl MatmulArgs {
    /// Whether the fused backend's decode GEMV runs this matmul (its own choice when
    /// [`MatmulArgs::form`] is `None`, provided x and W are 16-byte aligned): `Ok`, or
    /// [`Error::NotSupported`] naming what keeps it on the cuDNN graph. Needs no GPU.
    /// `weight` is W's element: `dtype`, or FP8 codes ([`DataType::F8E4M3`]; [`DataType::F8E5M2`]
    /// without the prologue, the up product or the rotary epilogue).
    pub fn decode_gemv(&self, dtype: DataType, weight: DataType, out: DataType) -> Result<()> {
        self.gemv(dtype, weight, out).map(drop)
    }

    /// The GEMV the fused backend takes by itself: where it applies, over at most
    /// [`DECODE_GEMV_AUTO_TOKENS`] tokens (any it takes over FP8 weights, which have no graph).
    pub(super) fn auto_gemv(&self, dtype: DataType, weight: DataType, out: DataType) -> Option<Gemv> {
        let most = if weight == dtype { DECODE_GEMV_AUTO_TOKENS } else { DECODE_GEMV_MAX_TOKENS };
        self.gemv(dtype, weight, out).ok().filter(|g| g.m <= most)
    }

    /// The GEMV launch for these arguments (already checked), or why there is none.
    pub(super) fn gemv(&self, dtype: DataType, weight: DataType, out: DataType) -> Result<Gemv> {
        let args = self.folded().unwrap_or(*self);
        let forms = args.forms().map(|f| format!(" {f}")).unwrap_or_default();
        let w = if weight == dtype { String::new() } else { format!(" weight {weight}") };
        let refuse = |reason: String| Error::NotSupported {
            op: format!("decode gemv {}{forms} {dtype}{w}->{out}", args.describe()),
            reason,
        };
        let (m, k, n) = (args.m(), args.k(), args.n());
        if args.batch() != 1 || args.b.dims[0] != 1 {
            return Err(refuse(format!(
                "a batch of {} products that does not fold into rows of one (the GEMV takes a Linear layer)",
                args.batch()
            )));
        }
        if m > DECODE_GEMV_MAX_TOKENS {
            return Err(refuse(format!(
                "{m} rows of A (tokens): the GEMV takes at most {DECODE_GEMV_MAX_TOKENS}, more reuse each \
                 weight enough for a tensor-core GEMM"
            )));
        }
        if dtype != DataType::BF16 && dtype != DataType::F16 {
            return Err(refuse(format!("{dtype} inputs: the GEMV takes bf16 or f16")));
        }
        if out != dtype {
            return Err(refuse(format!("a {out} output: the GEMV writes its input dtype {dtype}")));
        }
        let fp8 = matches!(weight, DataType::F8E4M3 | DataType::F8E5M2);
        if weight != dtype && !fp8 {
            return Err(refuse(format!("a {weight} weight: the GEMV reads weights in {dtype} or FP8")));
        }
        if weight == DataType::F8E5M2 && args.forms().is_some() {
            return Err(refuse(
                "E5M2 weights with a fused form: the forms read E4M3 weights (E5M2 is for gradients)".into(),
            ));
        }
        // Elements of a 16-byte chunk of W: 8 in 16 bits, 16 FP8 codes.
        let per_chunk = if fp8 { 16 } else { 8 };
        if args.a.strides[2] != 1 {
            return Err(refuse(format!("A strides {:?}: A must be row-major", args.a.strides)));
        }
        if args.b.strides[1] != 1 {
            return Err(refuse(format!(
                "B strides {:?}: B must be the transposed view of a row-major [n, k] weight \
                 (MatmulArgs::linear)",
                args.b.strides
            )));
        }
        let (ldx, ldw) = (args.a.strides[1], args.b.strides[2]);
        for (what, v, used, unit) in [
            ("k", k, true, per_chunk),
            ("A's row stride", ldx, m > 1, 8),
            ("the weight's row stride", ldw, n > 1, per_chunk),
        ] {
            if used && !v.is_multiple_of(unit) {
                return Err(refuse(format!(
                    "{what} {v} is not a multiple of {unit} elements (the GEMV reads 16-byte chunks)"
                )));
            }
        }
        if k > i32::MAX as usize || n > i32::MAX as usize {
            return Err(refuse(format!("k = {k}, n = {n}: the GEMV indexes rows and chunks with 32 bits")));
        }
        let Some((tile, rows_per_warp)) = TILES.into_iter().find(|&(tile, _)| tile >= m) else {
            return Err(refuse(format!("{m} rows of A (tokens): no token tile holds them")));
        };
        let mut g = Gemv {
            m,
            k,
            n,
            ldx,
            ldw,
            tile,
            rows_per_warp,
            block: false,
            dtype,
            weight,
            epilogue: args.epilogue,
            prologue: args.prologue,
            dual: args.up_product,
            rotary: args.rotary,
            deep: false,
            no_trigger: false,
        };
        if let Some(form) = g.fused_form() {
            if m != 1 {
                return Err(refuse(format!(
                    "{m} rows of A (tokens): the prologue, the up product and the rotary epilogue run at one token \
                     (a decode step)"
                )));
            }
            let Some(&(_, rows, _)) = FUSED_TILES.iter().find(|t| t.0 == form) else {
                return Err(refuse(format!("the {form} form has no kernel tile")));
            };
            (g.tile, g.rows_per_warp) = (1, rows);
        }
        Ok(g)
    }
}

/// Launches `g` on the buffers of `x` (checked against the arguments `g` came from), split as the
/// context says ([`Gemv::with_split`]) and as a programmatic dependent launch where the context allows
/// it ([`Exec::programmatic_launch`](crate::Exec::programmatic_launch): the kernels prefetch their
/// first chunks of W into L2, then wait for the kernel before them), and counts it in
/// [`Cudnn::kernel_runs`]. Returns false, having launched nothing, when x or W is not 16-byte aligned.
pub(super) fn launch_gemv<T: Element, O: Element, W: Element>(
    ctx: &Cudnn,
    g: &Gemv,
    x: &mut MatmulOperands<'_, T, O, W>,
) -> Result<bool> {
    if x.before_collective && g.fused_form().is_some() {
        return Err(Error::NotSupported {
            op: g.describe(),
            reason: "the fused forms let the next kernel start early; only the plain GEMV runs before a \
                     collective that does not wait for it"
                .into(),
        });
    }
    let g = Gemv { no_trigger: x.before_collective, ..*g };
    let g = &g.with_split(ctx.gemv_split()).for_sms(ctx.info().sm_count);
    let (kernels, cfg, kernel) = (Kernels::get(ctx)?, g.config()?, g.kernel());
    let stream = ctx.stream();
    let (a, _ga) = x.a.device_ptr(stream);
    let (b, _gb) = x.b.device_ptr(stream);
    if !a.is_multiple_of(16) || !b.is_multiple_of(16) {
        return Ok(false);
    }
    let (norm_w, _gn) = optional_ptr(x.norm_weight, stream);
    let (b_up, _gu) = optional_ptr(x.up_weight, stream);
    if (g.dual && !b_up.is_multiple_of(16)) || (g.prologue.is_some() && !norm_w.is_multiple_of(16)) {
        return Ok(false);
    }
    let (bias, _g1) = optional_ptr(x.bias, stream);
    let (up, _g2) = optional_ptr(x.up, stream);
    let (residual, _g3) = optional_ptr(x.residual, stream);
    let (d, _gd) = x.d.device_ptr_mut(stream);
    // FP8 weights' factors (checked with the operands: one, or one per row of W and of W_up).
    let (wsc, _gws) = optional_ptr(x.b_scale, stream);
    let (usc, _gus) = optional_ptr(x.up_scale, stream);
    let wsr = Arg::I64(i64::from(x.b_scale.is_some_and(|s| s.len() > 1)));
    let i = |v: usize| Arg::I64(v as i64);
    let epilogue = [
        Arg::Ptr(bias),
        Arg::I64(activation_code(g.epilogue.activation)),
        Arg::Ptr(up),
        Arg::Ptr(residual),
        Arg::Ptr(d),
    ];
    let head: Vec<Arg> = if g.fused_form().is_some() || g.block {
        let eps = g.prologue.map_or(0.0, Prologue::epsilon);
        vec![
            Arg::Ptr(a),
            Arg::Ptr(norm_w),
            Arg::F32(eps),
            Arg::Ptr(b),
            Arg::Ptr(b_up),
            i(g.ldw),
            Arg::Ptr(wsc),
            Arg::Ptr(usc),
            wsr,
            i(g.k),
            i(g.n),
        ]
    } else {
        vec![Arg::Ptr(a), i(g.ldx), Arg::Ptr(b), i(g.ldw), Arg::Ptr(wsc), wsr, i(g.m), i(g.k), i(g.n)]
    };
    let mut args: Vec<Arg> = head.into_iter().chain(epilogue).collect();
    if g.fused_form().is_none() && !g.block {
        // The plain tiles' `trigger`.
        args.push(Arg::I64(i64::from(!g.no_trigger)));
    }
    // The rotary epilogue's tables, position and caches (checked against `g.rotary` by the caller;
    // the kernel would read arguments it was not given without them).
    if g.rotary.is_some() != x.rotary.is_some() {
        return Err(Error::invalid("decode gemv: the rotary epilogue and its operands come together"));
    }
    let mut guards = Vec::new();
    if let (Some(r), Some(ops)) = (g.rotary, x.rotary.as_mut()) {
        let (cos, sin) = ops.tables.half_tables();
        let (c, gc) = cos.device_ptr(stream);
        let (s, gs) = sin.device_ptr(stream);
        let (pos, gp) = ops.position.device_ptr(stream);
        let (kc, gk) = ops.k.device_ptr_mut(stream);
        let (vc, gv) = ops.v.device_ptr_mut(stream);
        guards.extend([gc, gs, gp, gk, gv]);
        args.extend([
            Arg::Ptr(c),
            Arg::Ptr(s),
            i(ops.tables.positions()),
            Arg::Ptr(pos),
            Arg::Ptr(kc),
            Arg::Ptr(vc),
            i(r.max_seq),
            i(r.heads_q),
            i(r.heads_kv),
            i(r.head_dim),
        ]);
    }
    launch_programmatic(ctx, kernels, &kernel, cfg, &args)?;
    drop(guards);
    let mut h = DefaultHasher::new();
    g.hash(&mut h);
    kernels.count_run(h.finish(), || g.describe());
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul::{MatmulKernel, MatrixLayout};

    const BF: DataType = DataType::BF16;

    fn refused(r: Result<Gemv>, expected: &str) {
        let e = r.expect_err(expected);
        assert!(e.is_not_supported(), "{expected}: {e:?}");
        let msg = e.to_string();
        assert!(msg.contains("decode gemv") && msg.contains(expected), "expected `{expected}` in: {msg}");
    }

    #[test]
    fn the_rotary_form_pairs_rows_and_has_no_block_split() {
        let rotary = Rotary::new(32, 8, 128, 642);
        let args = MatmulArgs::linear(1, 4096, 6144).with_rotary(rotary);
        let g = args.gemv(BF, BF, BF).unwrap();
        assert_eq!((g.kernel(), g.rows_per_warp), ("gemv_bf16_m1_rope".to_string(), 2));
        let normed = args
            .with_prologue(Prologue::rms_norm(1e-5))
            .gemv(DataType::F16, DataType::F16, DataType::F16)
            .unwrap();
        assert_eq!(normed.kernel(), "gemv_f16_m1_norm_rope");
        // A warp per pair of rows: 3072 warps, 768 blocks, whatever the split asked for.
        let blocked = normed.with_split(GemvSplit::Block);
        assert_eq!(
            (blocked.kernel(), blocked.config().unwrap().grid_dim.0),
            ("gemv_f16_m1_norm_rope".into(), 768)
        );
        assert!(g.describe().contains("rope(32/8x128)"), "{}", g.describe());
        refused(MatmulArgs::linear(2, 4096, 6144).with_rotary(rotary).gemv(BF, BF, BF), "at one token");
    }

    #[test]
    fn the_rotary_form_streams_deeper_where_its_grid_has_few_row_pairs_per_sm() {
        // Llama-3.1-8B's qkv_proj on one GPU (3072 pairs) and on each of two ranks (1536), on 132 SMs.
        let norm = Prologue::rms_norm(1e-5);
        let one = MatmulArgs::linear(1, 4096, 6144).with_rotary(Rotary::new(32, 8, 128, 642));
        let rank = MatmulArgs::linear(1, 4096, 3072).with_rotary(Rotary::new(16, 4, 128, 642));
        let on = |a: MatmulArgs, sms| a.with_prologue(norm).gemv(BF, BF, BF).unwrap().for_sms(sms);
        assert_eq!(on(one, 132).kernel(), "gemv_bf16_m1_norm_rope");
        assert_eq!(on(rank, 132).kernel(), "gemv_bf16_m1_norm_rope_u4");
        assert_eq!(
            rank.gemv(DataType::F16, DataType::F16, DataType::F16).unwrap().for_sms(132).kernel(),
            "gemv_f16_m1_rope_u4"
        );
        // The threshold: 16 pairs per SM, so 3072 pairs are deep below 192 SMs, and the grid is the
        // same (a warp per pair).
        assert_eq!(on(one, 193).kernel(), "gemv_bf16_m1_norm_rope_u4");
        assert_eq!(on(one, 192).kernel(), "gemv_bf16_m1_norm_rope");
        assert_eq!(on(rank, 132).config().unwrap().grid_dim.0, 1536 / 4);
        // Only the rotary form: the other one-token forms keep their tiles on any GPU.
        for a in [MatmulArgs::linear(1, 4096, 3072), MatmulArgs::linear(1, 4096, 3072).with_prologue(norm)] {
            let g = a.gemv(BF, BF, BF).unwrap();
            assert_eq!(g.for_sms(132).kernel(), g.kernel());
        }
    }

    #[test]
    fn llama_decode_shapes_take_the_gemv() {
        for (k, n) in [(4096, 6144), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256)] {
            for m in 1..=DECODE_GEMV_MAX_TOKENS {
                for e in [Epilogue::NONE, Epilogue::RESIDUAL, Epilogue::SWIGLU] {
                    for dtype in [DataType::BF16, DataType::F16] {
                        let g =
                            MatmulArgs::linear(m, k, n).with_epilogue(e).gemv(dtype, dtype, dtype).unwrap();
                        assert_eq!((g.m, g.k, g.n, g.ldx, g.ldw, g.epilogue), (m, k, n, k, k, e));
                        assert!(g.tile >= m && g.tile < 2 * m, "m {m}: tile {}", g.tile);
                    }
                }
            }
        }
        let g = MatmulArgs::linear(3, 4096, 4096).gemv(BF, BF, BF).unwrap();
        assert_eq!((g.tile, g.rows_per_warp, g.kernel()), (4, 2, "gemv_bf16_m4".to_string()));
        assert_eq!(
            MatmulArgs::linear(1, 64, 8).gemv(DataType::F16, DataType::F16, DataType::F16).unwrap().kernel(),
            "gemv_f16_m1"
        );
        assert_eq!(
            MatmulArgs::linear(1, 4096, 6144)
                .with_epilogue(Epilogue::RESIDUAL)
                .gemv(BF, BF, BF)
                .unwrap()
                .describe(),
            "decode gemv [1, 4096] x [4096, 6144] bf16 epilogue residual (gemv_bf16_m1)"
        );
        // Small and odd: k = 8, n = 1, n not a multiple of a warp's rows.
        for (m, k, n) in [(1, 8, 1), (3, 8, 5), (8, 16, 7), (5, 4104, 13)] {
            let g = MatmulArgs::linear(m, k, n).gemv(BF, BF, BF).unwrap();
            let cfg = g.config().unwrap();
            let warps = cfg.grid_dim.0 as usize * BLOCK / 32;
            assert!(warps * g.rows_per_warp >= n && (warps - BLOCK / 32) * g.rows_per_warp < n, "{g:?}");
        }
        // A batch that folds into rows over a shared weight is a Linear layer of batch · m tokens.
        let shared = MatmulArgs::new(MatrixLayout::row_major(2, 3, 64), MatmulArgs::linear(1, 64, 128).b);
        assert_eq!(shared.gemv(BF, BF, BF).unwrap().m, 6);
        // The whole table is reachable.
        let tiles: Vec<usize> =
            (1..=8).map(|m| MatmulArgs::linear(m, 64, 64).gemv(BF, BF, BF).unwrap().tile).collect();
        assert_eq!(tiles, [1, 2, 4, 4, 8, 8, 8, 8]);
    }

    #[test]
    fn everything_else_stays_on_the_graph_and_says_why() {
        let lin = MatmulArgs::linear(1, 4096, 4096);
        refused(
            MatmulArgs::linear(9, 4096, 4096).gemv(BF, BF, BF),
            "9 rows of A (tokens): the GEMV takes at most 8",
        );
        refused(MatmulArgs::linear(2048, 4096, 4096).gemv(BF, BF, BF), "2048 rows of A");
        refused(lin.gemv(DataType::F32, DataType::F32, DataType::F32), "f32 inputs");
        refused(lin.gemv(BF, BF, DataType::F32), "a f32 output: the GEMV writes its input dtype bf16");
        refused(MatmulArgs::packed(1, 1, 4096, 4096).gemv(BF, BF, BF), "B must be the transposed view");
        let col_a = MatmulArgs::new(MatrixLayout::column_major(1, 2, 64), MatmulArgs::linear(2, 64, 64).b);
        refused(col_a.gemv(BF, BF, BF), "A must be row-major");
        refused(MatmulArgs::packed(2, 1, 64, 64).gemv(BF, BF, BF), "a batch of 2 products");
        let per_batch_w =
            MatmulArgs::new(MatrixLayout::row_major(2, 1, 64), MatrixLayout::column_major(2, 64, 64));
        refused(per_batch_w.gemv(BF, BF, BF), "a batch of 2 products that does not fold");
        // Strides and k that are not whole 16-byte chunks (the shared check refuses these for bf16 too).
        let padded = MatmulArgs::new(
            MatrixLayout::strided([1, 2, 64], [2 * 68, 68, 1]),
            MatmulArgs::linear(2, 64, 64).b,
        );
        refused(padded.gemv(BF, BF, BF), "A's row stride 68 is not a multiple of 8");
        refused(MatmulArgs::linear(1, 12, 64).gemv(BF, BF, BF), "k 12 is not a multiple of 8");
        let w_padded =
            MatmulArgs::new(MatrixLayout::row_major(1, 1, 64), MatrixLayout::strided([1, 64, 4], [0, 1, 66]));
        refused(w_padded.gemv(BF, BF, BF), "the weight's row stride 66");
        // One token or one output: its unused stride may be anything.
        let one = MatmulArgs::new(
            MatrixLayout::strided([1, 1, 64], [64, 3, 1]),
            MatrixLayout::strided([1, 64, 1], [0, 1, 5]),
        );
        assert_eq!(one.gemv(BF, BF, BF).unwrap().m, 1);
        // The public check agrees, and so does what the fused backend says it runs.
        assert!(lin.decode_gemv(BF, BF, BF).is_ok());
        assert!(MatmulArgs::linear(9, 64, 64).decode_gemv(BF, BF, BF).unwrap_err().is_not_supported());
        assert_eq!(lin.fused_kernel(BF, BF), MatmulKernel::DecodeGemv);
        assert_eq!(lin.fused_kernel(DataType::F32, DataType::F32), MatmulKernel::Graph);
        assert_eq!(MatmulArgs::linear(9, 64, 64).fused_kernel(BF, BF), MatmulKernel::Graph);
        assert_eq!(lin.with_form(MatmulKernel::Graph).fused_kernel(BF, BF), MatmulKernel::Graph);
        let forced = MatmulArgs::linear(9, 64, 64).with_form(MatmulKernel::DecodeGemv);
        assert_eq!(forced.fused_kernel(BF, BF), MatmulKernel::DecodeGemv);
    }

    #[test]
    fn one_token_takes_the_norm_and_dual_forms() {
        let norm = Prologue::rms_norm(1e-5);
        let qkv = MatmulArgs::linear(1, 4096, 6144).with_prologue(norm);
        let g = qkv.gemv(BF, BF, BF).unwrap();
        assert_eq!((g.kernel(), g.rows_per_warp, g.tile), ("gemv_bf16_m1_norm".to_string(), 2, 1));
        assert_eq!(
            g.describe(),
            "decode gemv rms_norm(1e-5) [1, 4096] x [4096, 6144] bf16 epilogue none (gemv_bf16_m1_norm)"
        );
        let gate = MatmulArgs::linear(1, 4096, 14336).with_epilogue(Epilogue::SWIGLU).with_up_product();
        let g = gate.gemv(DataType::F16, DataType::F16, DataType::F16).unwrap();
        assert_eq!((g.kernel(), g.config().unwrap().shared_mem_bytes), ("gemv_f16_m1_dual".to_string(), 0));
        let g = gate.with_prologue(norm).gemv(BF, BF, BF).unwrap();
        assert_eq!(g.kernel(), "gemv_bf16_m1_norm_dual");
        assert!(
            g.describe().ends_with("epilogue silu+gate up-product (gemv_bf16_m1_norm_dual)"),
            "{}",
            g.describe()
        );
        // The fused backend takes them by itself at one token.
        assert_eq!(qkv.fused_kernel(BF, BF), MatmulKernel::DecodeGemv);
        assert_eq!(gate.auto_gemv(BF, BF, BF).map(|g| g.dual), Some(true));
        // More tokens: refused, named.
        refused(
            MatmulArgs::linear(2, 4096, 6144).with_prologue(norm).gemv(BF, BF, BF),
            "2 rows of A (tokens): the prologue, the up product and the rotary epilogue run at one token",
        );
        refused(
            MatmulArgs::linear(2, 64, 64).with_epilogue(Epilogue::SWIGLU).with_up_product().gemv(BF, BF, BF),
            "run at one token",
        );
        // The prologue keeps nothing in shared memory, so it takes any row length, in both splits.
        let g = MatmulArgs::linear(1, 65536, 64).with_prologue(norm).gemv(BF, BF, BF).unwrap();
        for g in [g, g.with_split(GemvSplit::Block)] {
            assert_eq!(g.config().unwrap().shared_mem_bytes, 0, "{}", g.kernel());
        }
        let e = MatmulArgs::linear(2, 64, 64).with_prologue(norm).gemv(BF, BF, BF).unwrap_err().to_string();
        assert!(e.contains("rms_norm(1e-5)"), "{e}");
    }

    #[test]
    fn activation_codes_match_the_kernel() {
        let src = include_str!("decode.cu");
        for a in Activation::ALL {
            let case = format!("case {}: return epi_{}(v);", activation_code(Some(a)), a.name());
            assert!(src.contains(&case), "decode.cu lacks `{case}`");
        }
        assert_eq!(activation_code(None), 0);
        for (tile, rows) in TILES {
            let line = format!("GEMV_KERNEL(sfx, D, W, {tile}, {rows}, ");
            assert!(src.contains(&line), "decode.cu lacks the tile `{line}`");
        }
        assert!(src.contains(&format!("__launch_bounds__({BLOCK})")));
        for (form, rows, chunks) in FUSED_TILES {
            let kernel = if form.ends_with("rope") { "GEMV_ROPE_KERNEL" } else { "GEMV_FUSED_KERNEL" };
            let line = format!("{kernel}(sfx, D, W, {form}, {rows}, {chunks}, ");
            assert!(src.contains(&line), "decode.cu lacks the fused form `{line}`");
        }
        assert!(
            src.contains(&format!("GEMV_KERNEL_U(sfx, D, W, {})", LONG_ROWS.1)),
            "decode.cu lacks the long-row tile"
        );
        for form in ["rope", "norm_rope"] {
            let line =
                format!("GEMV_ROPE_KERNEL(sfx, D, W, {form}_u{DEEP_ROPE_CHUNKS}, 2, {DEEP_ROPE_CHUNKS}, ");
            assert!(src.contains(&line), "decode.cu lacks the deep rotary form `{line}`");
        }
        for (form, rows, chunks) in BLOCK_TILES {
            let form = if form.is_empty() { String::new() } else { format!("_{form}") };
            let line = format!("GEMV_BLOCK_KERNEL(gemv_##sfx##_m1{form}_block, D, W, {rows}, {chunks}, ");
            assert!(src.contains(&line), "decode.cu lacks the block form `{line}`");
        }
        assert!(src.contains("#define GEMV_WARPS 4") && BLOCK == 32 * 4);
    }

    #[test]
    fn auto_keeps_warps_and_block_is_taken_only_when_forced_at_one_token() {
        let norm = Prologue::rms_norm(1e-5);
        let swiglu = Epilogue::SWIGLU;
        let on = |a: MatmulArgs, split| a.gemv(BF, BF, BF).unwrap().with_split(split);
        // Llama-3.1-8B's one-token projections: the block form lost on the H200, so auto keeps warps.
        let cases = [
            MatmulArgs::linear(1, 4096, 6144).with_prologue(norm),
            MatmulArgs::linear(1, 4096, 6144),
            MatmulArgs::linear(1, 4096, 4096).with_epilogue(Epilogue::RESIDUAL),
            MatmulArgs::linear(1, 4096, 14336).with_epilogue(swiglu).with_up_product().with_prologue(norm),
            MatmulArgs::linear(1, 14336, 4096).with_epilogue(Epilogue::RESIDUAL),
            MatmulArgs::linear(1, 4096, 128256),
        ];
        for args in cases {
            let g = on(args, GemvSplit::Auto);
            assert!(!g.block && !g.kernel().ends_with("_block"), "{args:?}: {}", g.kernel());
            let warp = g.kernel().replace("_u2", ""); // the long-row tile has no block form of its own
            assert_eq!(on(args, GemvSplit::Block).kernel(), format!("{warp}_block"), "{args:?}");
        }
        // Forced either way at one token; more tokens keep warps whatever is asked.
        let gate = MatmulArgs::linear(1, 4096, 14336).with_epilogue(swiglu).with_up_product();
        let g = on(gate, GemvSplit::Block);
        assert_eq!((g.kernel().as_str(), g.config().unwrap().grid_dim.0), ("gemv_bf16_m1_dual_block", 14336));
        assert_eq!(on(MatmulArgs::linear(1, 4096, 4096), GemvSplit::Warp).kernel(), "gemv_bf16_m1");
        let f16 = MatmulArgs::linear(1, 64, 40)
            .with_prologue(norm)
            .gemv(DataType::F16, DataType::F16, DataType::F16)
            .unwrap();
        let g = f16.with_split(GemvSplit::Block);
        let c = g.config().unwrap();
        assert_eq!(g.kernel(), "gemv_f16_m1_norm_block");
        assert_eq!((c.grid_dim, c.block_dim, c.shared_mem_bytes), ((20, 1, 1), (128, 1, 1), 0));
        for m in 2..=DECODE_GEMV_MAX_TOKENS {
            let g = on(MatmulArgs::linear(m, 4096, 4096), GemvSplit::Block);
            assert_eq!(g, MatmulArgs::linear(m, 4096, 4096).gemv(BF, BF, BF).unwrap(), "m {m}");
        }
        assert!(g.describe().ends_with("(gemv_f16_m1_norm_block)"), "{}", g.describe());
    }

    #[test]
    fn fp8_weights_name_their_kernels_and_keep_the_warp_form() {
        let src = include_str!("decode.cu");
        let (e4, e5, f16) = (DataType::F8E4M3, DataType::F8E5M2, DataType::F16);
        let plain =
            |m: usize, x: DataType, w: DataType| MatmulArgs::linear(m, 4096, 4096).gemv(x, w, x).unwrap();
        assert_eq!(plain(1, BF, e4).kernel(), "gemv_bf16_e4m3_m1");
        assert_eq!(plain(3, f16, e5).kernel(), "gemv_f16_e5m2_m4");
        assert_eq!(
            MatmulArgs::linear(1, 14336, 4096).gemv(BF, e4, BF).unwrap().kernel(),
            "gemv_bf16_e4m3_m1_u2"
        );
        let dual = MatmulArgs::linear(1, 4096, 14336)
            .with_epilogue(Epilogue::SWIGLU)
            .with_up_product()
            .with_prologue(Prologue::rms_norm(1e-5));
        let g = dual.gemv(BF, e4, BF).unwrap();
        assert_eq!(g.kernel(), "gemv_bf16_e4m3_m1_norm_dual");
        assert!(g.describe().contains("bf16 weight fp8e4m3"), "{}", g.describe());
        // No block split for FP8 weights (the block kernels read 16-bit weights).
        assert_eq!(g.with_split(GemvSplit::Block).kernel(), "gemv_bf16_e4m3_m1_norm_dual");
        for sfx in ["bf16_e4m3", "bf16_e5m2", "f16_e4m3", "f16_e5m2"] {
            assert!(src.contains(&format!("GEMV_TILES({sfx}, ")), "{sfx}");
        }
        for sfx in ["bf16_e4m3", "f16_e4m3"] {
            assert!(src.contains(&format!("GEMV_FUSED({sfx}, ")), "{sfx}");
        }
        // k in 16-byte chunks of 16 codes.
        let e = MatmulArgs::linear(1, 4104, 64).gemv(BF, e4, BF).unwrap_err();
        assert!(e.to_string().contains("k 4104 is not a multiple of 16 elements"), "{e}");
        let e = MatmulArgs::linear(1, 64, 64).gemv(BF, f16, BF).unwrap_err();
        assert!(e.to_string().contains("a f16 weight"), "{e}");
    }

    #[test]
    fn before_a_collective_the_plain_gemv_takes_the_warp_form_whose_kernels_take_a_trigger() {
        // The plain tiles take `trigger` last (launch_gemv passes it); the block kernels always
        // trigger, so a GEMV before a collective keeps the warp form whatever the split.
        let src = include_str!("decode.cu");
        assert_eq!(src.matches("long trigger) {").count(), 1, "GEMV_KERNEL_NAMED: every plain tile");
        assert!(src.contains("if (trigger && row0 == first) pdl_launch_dependents();"));
        let g = MatmulArgs::linear(1, 4096, 4096).with_epilogue(Epilogue::RESIDUAL).gemv(BF, BF, BF).unwrap();
        let quiet = Gemv { no_trigger: true, ..g };
        assert!(g.with_split(GemvSplit::Block).block);
        let q = quiet.with_split(GemvSplit::Block);
        assert!(!q.block && q.kernel() == "gemv_bf16_m1", "{}", q.kernel());
        let down = MatmulArgs::linear(1, 7168, 4096).gemv(BF, BF, BF).unwrap();
        assert_eq!(
            Gemv { no_trigger: true, ..down }.with_split(GemvSplit::Block).kernel(),
            "gemv_bf16_m1_u2"
        );
    }

    #[test]
    fn long_rows_take_the_two_chunk_tile_at_one_token_only() {
        let kernel = |m, k, n| MatmulArgs::linear(m, k, n).gemv(BF, BF, BF).unwrap().kernel();
        // Llama-3.1-8B's down projection on one GPU (k 14336) and on a TP2 rank (k 7168); o_proj and
        // lm_head (k 4096, 2048) keep three.
        assert_eq!(kernel(1, 14336, 4096), "gemv_bf16_m1_u2");
        assert_eq!(kernel(1, LONG_ROWS.0, 4096), "gemv_bf16_m1_u2");
        assert_eq!(kernel(1, LONG_ROWS.0 - 8, 4096), "gemv_bf16_m1");
        assert_eq!(kernel(1, 4096, 128256), "gemv_bf16_m1");
        // More tokens keep their tiles; the fused forms and the block split keep theirs.
        assert_eq!(kernel(2, 14336, 4096), "gemv_bf16_m2");
        let norm = MatmulArgs::linear(1, 14336, 4096).with_prologue(Prologue::rms_norm(1e-5));
        assert_eq!(norm.gemv(BF, BF, BF).unwrap().kernel(), "gemv_bf16_m1_norm");
        let g = MatmulArgs::linear(1, 14336, 4096).gemv(BF, BF, BF).unwrap().with_split(GemvSplit::Block);
        assert_eq!(g.kernel(), "gemv_bf16_m1_block");
        assert_eq!(
            MatmulArgs::linear(1, 14336, 4096)
                .gemv(DataType::F16, DataType::F16, DataType::F16)
                .unwrap()
                .kernel(),
            "gemv_f16_m1_u2"
        );
    }
}
