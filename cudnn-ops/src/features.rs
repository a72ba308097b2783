//! What the running cuDNN can do: one [`Features`] value, computed when a [`crate::Cudnn`] opens from
//! `cudnnGetVersion()`, the version of the headers the bindings come from and the GPU's compute
//! capability. Every version threshold of the crate is here; graphs and ops ask for a feature by name.

/// First version whose masks fill with `-inf` (the lowest finite float before).
const NEG_INFINITY_MASK_FILL: usize = 91000;
/// First version whose attention-backward engines zero their f32 dQ accumulator themselves (the
/// frontend memsets it before each execution below this).
const SDPA_BACKWARD_ZEROES_DQ_ACCUM: usize = 90600;
/// First version whose attention-backward engines take any K/V length: up to 9.15.0 the frontend adds a
/// padding mask with full lengths when `s_kv % 128 != 0` (an illegal memory access under CUDA-graph
/// replay and NaNs otherwise, fixed in 9.15.1).
const SDPA_BACKWARD_ANY_SEQ_KV: usize = 91501;
/// First version with head dim 256 on Blackwell (and later) GPUs.
const WIDE_HEADS_AFTER_HOPPER: usize = 91100;
/// First version with the unified SDPA operation (`OPERATION_SDPA_FWD`), unmasked.
const UNIFIED_SDPA: usize = 91301;
/// First version whose unified SDPA takes per-sequence lengths from device tensors.
const SDPA_SEQ_LENS: usize = 91500;
/// First version whose unified SDPA reads K and V through page tables
/// (`CUDNN_ATTR_OPERATION_SDPA_FWD_PAGE_TABLE_KDESC` / `_VDESC`, with device sequence lengths).
const SDPA_PAGED: usize = 91500;
/// First version whose matmul engines we found right on a workspace that is not zeroed per call, and
/// right for a B broadcast across batches.
const MATMUL_FIXES: usize = 91900;
/// First version with diagonal bounds (causal masks) on the unified SDPA operation.
const UNIFIED_SDPA_CAUSAL: usize = 92100;
/// First version with engines for a norm backward followed by an add of the residual stream's
/// gradient (NVIDIA/TransformerEngine#2778: "From CUDNN 9.21 ... fusing the dLN + add backward").
const NORM_BACKWARD_ADD: usize = 92100;
// No version enables the unified SDPA backward (`OPERATION_SDPA_BWD`): the frontend never builds it and
// a raw-API client reports it does not finalize on 9.19/9.20, so attention backward is the composite
// graph on every version (add a threshold and a feature here once one is known to work).

/// What the running cuDNN and GPU support, as graph forms and workarounds.
///
/// Features of the graph API need both the running library and the headers the bindings were
/// generated from (an attribute missing from the headers cannot be set): they follow the older of
/// the two, as the frontend's choices do. Behaviours of the library alone (mask fill, engine fixes)
/// follow the running version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Features {
    runtime: usize,
    header: usize,
    compute_capability: (i32, i32),
}

impl Features {
    /// The features of cuDNN `runtime` (a `cudnnGetVersion()` number, e.g. 91900) driven through
    /// bindings from headers `header`, on a GPU of `compute_capability` (major, minor).
    pub fn new(runtime: usize, header: usize, compute_capability: (i32, i32)) -> Self {
        Features { runtime, header, compute_capability }
    }

    /// The features of cuDNN `runtime` through this build's bindings ([`crate::HEADER_VERSION`]), on a
    /// GPU of `compute_capability`: what [`crate::Exec::features`] holds on such a system.
    pub fn for_version(runtime: usize, compute_capability: (i32, i32)) -> Self {
        Self::new(runtime, crate::HEADER_VERSION, compute_capability)
    }

    /// The running library's `cudnnGetVersion()`.
    pub fn cudnn_version(&self) -> usize {
        self.runtime
    }

    /// The older of the running library and the headers: what graph attributes may be used.
    fn graph_version(&self) -> usize {
        self.runtime.min(self.header)
    }

    /// The unified SDPA operation (one `OPERATION_SDPA_FWD` node), unmasked: cuDNN 9.13.1.
    pub fn unified_sdpa(&self) -> bool {
        self.graph_version() >= UNIFIED_SDPA
    }

    /// Causal masks (diagonal bounds) on the unified SDPA operation: cuDNN 9.21 (library and headers).
    pub fn unified_sdpa_causal(&self) -> bool {
        self.graph_version() >= UNIFIED_SDPA_CAUSAL
    }

    /// Per-sequence lengths read from device tensors on the unified SDPA operation (one padded plan
    /// for every length up to its capacity; paged K/V): cuDNN 9.15.
    pub fn sdpa_seq_lens(&self) -> bool {
        self.graph_version() >= SDPA_SEQ_LENS
    }

    /// K and V read through page tables on the unified SDPA operation
    /// (`CUDNN_ATTR_OPERATION_SDPA_FWD_PAGE_TABLE_KDESC` / `_VDESC`; a paged KV cache): cuDNN 9.15
    /// (library and headers).
    pub fn sdpa_paged(&self) -> bool {
        self.graph_version() >= SDPA_PAGED
    }

    /// Whether masked attention scores are filled with `-inf` (cuDNN 9.10) rather than the lowest
    /// finite float.
    pub fn neg_infinity_mask_fill(&self) -> bool {
        self.runtime >= NEG_INFINITY_MASK_FILL
    }

    /// The largest head dim fused attention takes: 256 on Hopper, and on Blackwell and later from
    /// cuDNN 9.11; 128 on Ampere/Ada (decode is capped there) and on Blackwell before 9.11; 0 before
    /// Ampere (no fused attention).
    pub fn max_sdpa_head_dim(&self) -> usize {
        match self.compute_capability.0 {
            ..=7 => 0,
            8 => 128,
            9 => 256,
            _ if self.runtime >= WIDE_HEADS_AFTER_HOPPER => 256,
            _ => 128,
        }
    }

    /// Whether the f32 dQ accumulator of the attention backward must be zeroed before each execution:
    /// cuDNN before 9.6 (from 9.6 the engines initialize it).
    pub fn sdpa_backward_zeroes_dq_accum(&self) -> bool {
        self.runtime < SDPA_BACKWARD_ZEROES_DQ_ACCUM
    }

    /// Whether the fused attention backward takes a K/V length that is not a multiple of 128 without
    /// the frontend's padding-mask workaround (not built here): cuDNN 9.15.1.
    pub fn sdpa_backward_any_seq_kv(&self) -> bool {
        self.runtime >= SDPA_BACKWARD_ANY_SEQ_KV
    }

    /// The largest head dim the fused attention backward takes: 256 on Hopper; 128 on Ampere/Ada and
    /// on Blackwell and later (the frontend's backward support surface; Blackwell's d_qk 192 with
    /// d_v 128 needs distinct head dims, which these ops do not have); 0 before Ampere.
    pub fn max_sdpa_backward_head_dim(&self) -> usize {
        match self.compute_capability.0 {
            ..=7 => 0,
            9 => 256,
            _ => 128,
        }
    }

    /// Matmuls whose B is shared across batches while A cannot fold its batch into rows: cuDNN 9.14
    /// returned wrong results for them in our tests, 9.19 did not.
    pub fn batch_broadcast_matmul(&self) -> bool {
        self.runtime >= MATMUL_FIXES
    }

    /// A norm backward whose dX feeds a pointwise add (the residual stream's gradient) in the same
    /// graph: cuDNN 9.21. The pattern needs no new attribute, so the running library decides.
    pub fn rmsnorm_backward_add(&self) -> bool {
        self.runtime >= NORM_BACKWARD_ADD
    }

    /// Whether plans zero their workspace before every execution: cuDNN before 9.19 has matmul engines
    /// (seen on 9.14 in the Llama MLP) that return wrong, run-to-run different results unless they
    /// find the workspace zeroed each time, as an earlier execution (even of the same plan) leaves it
    /// otherwise. A workspace zeroed before every call made them right; 9.19 needs nothing.
    pub fn zeroes_workspace(&self) -> bool {
        self.runtime < MATMUL_FIXES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOPPER: (i32, i32) = (9, 0);

    #[test]
    fn graph_features_follow_the_older_of_library_and_headers() {
        let f = |runtime, header| Features::new(runtime, header, HOPPER);
        assert!(!f(91300, 91900).unified_sdpa() && f(91301, 91900).unified_sdpa());
        assert!(!f(91900, 91200).unified_sdpa(), "old headers hold the unified node back");
        assert!(!f(91400, 91900).sdpa_seq_lens() && f(91500, 91900).sdpa_seq_lens());
        assert!(!f(91900, 91400).sdpa_seq_lens());
        assert!(!f(91400, 91900).sdpa_paged() && f(91500, 91900).sdpa_paged());
        assert!(!f(91900, 91400).sdpa_paged(), "the page-table attributes need 9.15 headers");
        // A 9.21 library through 9.19 headers: the mask attributes are not in the bindings.
        assert!(!f(92100, 91900).unified_sdpa_causal() && f(92100, 92100).unified_sdpa_causal());
    }

    #[test]
    fn library_behaviours_follow_the_running_version() {
        let f = |runtime| Features::new(runtime, 90000, HOPPER);
        assert!(!f(90900).neg_infinity_mask_fill() && f(91000).neg_infinity_mask_fill());
        assert!(f(91400).zeroes_workspace() && !f(91900).zeroes_workspace());
        assert!(f(90500).sdpa_backward_zeroes_dq_accum() && !f(90600).sdpa_backward_zeroes_dq_accum());
        assert!(!f(91500).sdpa_backward_any_seq_kv() && f(91501).sdpa_backward_any_seq_kv());
        assert!(!f(91400).batch_broadcast_matmul() && f(91900).batch_broadcast_matmul());
        assert!(!f(91900).rmsnorm_backward_add() && f(92100).rmsnorm_backward_add());
    }

    #[test]
    fn max_head_dim_follows_the_gpu_and_version() {
        let dim = |cc, v| Features::for_version(v, cc).max_sdpa_head_dim();
        assert_eq!(dim((9, 0), 91400), 256);
        assert_eq!(dim((8, 0), 91900), 128);
        assert_eq!(dim((10, 0), 91000), 128);
        assert_eq!(dim((10, 0), 91900), 256);
        assert_eq!(dim((7, 5), 91900), 0);
        let bwd = |cc| Features::for_version(91900, cc).max_sdpa_backward_head_dim();
        assert_eq!(
            (bwd((9, 0)), bwd((8, 0)), bwd((10, 0)), bwd((12, 0)), bwd((7, 5))),
            (256, 128, 128, 128, 0)
        );
    }

    #[test]
    fn for_version_uses_this_build_s_headers() {
        let f = Features::for_version(99900, HOPPER);
        assert_eq!(f, Features::new(99900, crate::HEADER_VERSION, HOPPER));
        assert_eq!(f.graph_version(), crate::HEADER_VERSION);
    }
}
