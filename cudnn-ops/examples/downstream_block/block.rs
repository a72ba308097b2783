// A Llama-3-style decoder block built on `cudnn-llm-ops`' public API only, as a crate that depends on it
// would (cudarc and half through its re-exports). Shared by the `downstream_block` example, the GPU
// test `tests/downstream_block.rs` (against an f64 reference) and the out-of-workspace crate
// `tests/downstream` (which checks that it builds as a dependent's code).
//
// x += o_proj(attend(cache, rope(qkv_proj(rms_norm(x)))));  x += down(silu(gate(h)) * up(h)), h = rms_norm(x)

use cudnn_llm_ops::cudarc::driver::CudaSlice;
use cudnn_llm_ops::half::bf16;
use cudnn_llm_ops::reference::random_values;
use cudnn_llm_ops::{
    matmul, rms_norm, AttendForm, Backend, Cudnn, Epilogue, KvCache, KvCacheShape, MatmulArgs,
    MatmulOperands, QkvRows, Result, RmsNormArgs, RmsNormOperands, RopeTables,
};

/// The block's sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub eps: f32,
}

impl Shape {
    /// Llama-3.2-1B's layer.
    pub fn llama_3_2_1b() -> Self {
        Shape { hidden: 2048, heads: 32, kv_heads: 8, head_dim: 64, ffn: 8192, eps: 1e-5 }
    }

    /// Elements of a fused Q/K/V row: `(heads + 2 · kv_heads) · head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// A cache of one layer for `batch` sequences of up to `max_seq` tokens.
    pub fn cache(&self, batch: usize, max_seq: usize) -> Result<KvCacheShape> {
        KvCacheShape::new(1, batch, max_seq, self.kv_heads, self.head_dim)
    }
}

/// The weights on the host, as a checkpoint stores them (Linear weights `[out, in]` row-major; the Q,
/// K and V projections stacked into one `[qkv_width, hidden]` matrix), already rounded to bf16.
pub struct HostWeights {
    pub attn_norm: Vec<f64>,
    pub wqkv: Vec<f64>,
    pub wo: Vec<f64>,
    pub mlp_norm: Vec<f64>,
    pub w_gate: Vec<f64>,
    pub w_up: Vec<f64>,
    pub w_down: Vec<f64>,
}

/// `n` values of `scale · U(-1, 1)` (plus `offset`), rounded to bf16.
pub fn random_bf16(seed: u64, n: usize, scale: f64, offset: f64) -> Vec<f64> {
    random_values(seed, n).iter().map(|v| bf16::from_f64(offset + scale * v).to_f64()).collect()
}

impl HostWeights {
    /// Random weights that keep activations near unit scale.
    pub fn random(s: &Shape, seed: u64) -> Self {
        let linear =
            |i: u64, out: usize, inp: usize| random_bf16(seed + i, out * inp, 1.0 / (inp as f64).sqrt(), 0.0);
        HostWeights {
            attn_norm: random_bf16(seed + 10, s.hidden, 0.1, 1.0),
            wqkv: linear(1, s.qkv_width(), s.hidden),
            wo: linear(2, s.hidden, s.heads * s.head_dim),
            mlp_norm: random_bf16(seed + 11, s.hidden, 0.1, 1.0),
            w_gate: linear(3, s.ffn, s.hidden),
            w_up: linear(4, s.ffn, s.hidden),
            w_down: linear(5, s.hidden, s.ffn),
        }
    }
}

/// One decoder block on the GPU, layer `layer` of the caches it is given.
pub struct Block {
    pub shape: Shape,
    pub layer: usize,
    attn_norm: CudaSlice<bf16>,
    wqkv: CudaSlice<bf16>,
    wo: CudaSlice<bf16>,
    mlp_norm: CudaSlice<bf16>,
    w_gate: CudaSlice<bf16>,
    w_up: CudaSlice<bf16>,
    w_down: CudaSlice<bf16>,
}

impl Block {
    /// Uploads `w`.
    pub fn new(ctx: &Cudnn, shape: Shape, layer: usize, w: &HostWeights) -> Result<Self> {
        let up = |v: &[f64]| -> Result<CudaSlice<bf16>> {
            let host: Vec<bf16> = v.iter().map(|&x| bf16::from_f64(x)).collect();
            Ok(ctx.stream().clone_htod(&host)?)
        };
        Ok(Block {
            shape,
            layer,
            attn_norm: up(&w.attn_norm)?,
            wqkv: up(&w.wqkv)?,
            wo: up(&w.wo)?,
            mlp_norm: up(&w.mlp_norm)?,
            w_gate: up(&w.w_gate)?,
            w_up: up(&w.w_up)?,
            w_down: up(&w.w_down)?,
        })
    }

    /// `out = block(x)` for the `batch · seq` rows of the step begun on `cache` (`cache.begin(ctx, seq)`
    /// first, `cache.finish()` after the last layer): appends the step's K and V to the cache and
    /// attends over it. Returns the attention form that ran.
    pub fn forward(
        &self,
        ctx: &Cudnn,
        cache: &mut KvCache<bf16>,
        rope: &RopeTables<bf16>,
        x: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        backend: Backend,
    ) -> Result<AttendForm> {
        let s = self.shape;
        let seq = cache.step().ok_or_else(|| {
            cudnn_llm_ops::Error::InvalidArgument("block: begin a step on the cache first".into())
        })?;
        let rows = cache.shape().batch * seq;
        let alloc = |n: usize| -> Result<CudaSlice<bf16>> { Ok(ctx.stream().alloc_zeros::<bf16>(rows * n)?) };
        let (mut h, mut qkv, mut o) = (alloc(s.hidden)?, alloc(s.qkv_width())?, alloc(s.heads * s.head_dim)?);
        let (mut x2, mut up, mut act) = (alloc(s.hidden)?, alloc(s.ffn)?, alloc(s.ffn)?);
        let norm = RmsNormArgs::new(rows, s.hidden, s.eps);
        let linear = |inp: usize, out: usize| MatmulArgs::linear(rows, inp, out);

        // Attention: RMSNorm, one QKV GEMM, RoPE on Q and K with the K/V append, causal GQA over the
        // cache, o_proj with the residual add in its epilogue.
        rms_norm(ctx, norm, RmsNormOperands::new(x, &self.attn_norm, &mut h), backend)?;
        matmul(
            ctx,
            &linear(s.hidden, s.qkv_width()),
            MatmulOperands::new(&h, &self.wqkv, &mut qkv),
            backend,
        )?;
        let qkv_rows = QkvRows::packed(s.heads, &cache.shape());
        cache.append_rotated(ctx, self.layer, rope, qkv_rows, qkv.as_view_mut(), backend)?;
        let form = cache.attend(ctx, self.layer, qkv_rows, qkv.as_view(), o.as_view_mut(), backend)?;
        let o_proj = linear(s.heads * s.head_dim, s.hidden).with_epilogue(Epilogue::RESIDUAL);
        matmul(ctx, &o_proj, MatmulOperands::new(&o, &self.wo, &mut x2).residual(x), backend)?;

        // MLP: RMSNorm, up, gate with SiLU and the product with up in its epilogue, down with the
        // residual add.
        rms_norm(ctx, norm, RmsNormOperands::new(&x2, &self.mlp_norm, &mut h), backend)?;
        matmul(ctx, &linear(s.hidden, s.ffn), MatmulOperands::new(&h, &self.w_up, &mut up), backend)?;
        let gate = linear(s.hidden, s.ffn).with_epilogue(Epilogue::SWIGLU);
        matmul(ctx, &gate, MatmulOperands::new(&h, &self.w_gate, &mut act).up(&up), backend)?;
        let down = linear(s.ffn, s.hidden).with_epilogue(Epilogue::RESIDUAL);
        matmul(ctx, &down, MatmulOperands::new(&act, &self.w_down, out).residual(&x2), backend)?;
        Ok(form)
    }
}
