//! Tensor parallelism on the GPUs of one host, in the Megatron style.
//!
//! ```text
//! rank r of n (one thread, one GPU, one Cudnn context, one NCCL communicator):
//! x = embed(tokens)                                  # replicated table
//! for each layer:
//!     h = attn_norm(x)                               # replicated
//!     qkv = h · W_qkv[r]ᵀ                            # column-parallel: heads r·h/n.., their K/V heads
//!     o = gqa(rope(qkv), cache[r])                   # the rank's heads; its cache holds its K/V heads
//!     x = all_reduce(o · W_o[r]ᵀ (+ x on rank 0))    # row-parallel; fwd.layer.attn.allreduce
//!     h = mlp_norm(x)
//!     x = all_reduce(down[r](silu(gate[r](h)) · up[r](h)) (+ x on rank 0))   # fwd.layer.mlp.allreduce
//! y = output_norm(x)
//! logits = all_gather(y · W_lm[r]ᵀ)                  # vocabulary-parallel; fwd.lm_head.allgather
//! ```
//!
//! | piece | what |
//! |---|---|
//! | [`ShardPlan`] | which slice of each Hugging Face tensor a rank holds ([`Part`], [`Slice`]), the rank's shapes ([`ShardPlan::local`]), the fused QKV rows, typed errors for what does not split |
//! | [`WeightSource`] ([`Checkpoint`](crate::weights::Checkpoint)) | a rank's slices from a memory-mapped checkpoint (only their bytes read) or drawn as [`Weights::random`](crate::weights::Weights::random) draws them |
//! | [`TpLlama`], [`Rank`] | the ranks: one thread each, jobs run on all of them, teardown when one fails; or this process's rank of a job of processes ([`TpLlama::join`], [`RankEnv`]) |
//! | [`crate::nccl`] | NCCL opened at run time, the communicators and the two collectives |
//!
//! **A rank is the decoder at smaller shapes.** Its layers are the single-GPU modules on its local
//! config (`heads / n` query heads, their K/V heads, `ffn / n` MLP rows): fused or naive per module
//! kind and layer as [`Backends`](crate::Backends) says, with the same fallbacks. Two things differ:
//! the projections that feed the residual stream (`o_proj`, `down`) add the residual in their
//! epilogue on rank 0 only, and an in-place NCCL all-reduce on the rank's stream follows each; and
//! `lm_head` holds the rank's vocabulary rows, its logits all-gathered.
//!
//! **One process, one thread per GPU.** NCCL's communicators for all GPUs come from one
//! `ncclCommInitAll` call (no unique id to pass between processes), each rank's `Cudnn` context and
//! shard live on its own thread (a context is not `Send`, and one host thread per GPU keeps every
//! GPU's launches flowing while the others launch), and a failure is an error value in one process
//! rather than a lost peer. The collectives are enqueued on the ranks' compute streams, so each
//! rank's decode step captures as one CUDA graph, all-reduces and all-gather included (NCCL 2.9+
//! captures collectives); the ranks replay theirs together. Between calls a rank's thread polls
//! for the next one for [`TpOptions::spin`] before it blocks: a woken thread starts late, and
//! unevenly across ranks, and every rank waits for the last in a step's first all-reduce (on two
//! H100s, polling took 0.15 ms off a TP2 decode step as the caller sees it).
//!
//! **Or one process per rank.** [`TpLlama::join`] makes this process one rank of a job of processes
//! (on one host or many), started by `cudnn-llm-launch` or torchrun: the ranks meet over TCP
//! ([`crate::nccl::rendezvous`]), make their communicators from rank 0's NCCL unique id, and each loads
//! only its slices. Every process makes the same calls; [`TpLlama::broadcast`] and
//! [`TpLlama::receive`] carry rank 0's tokens to the others.
//!
//! **Failures do not hang.** A call waits for every rank up to [`TpOptions::timeout`]; a rank that
//! returns an error, panics or stays silent gets every communicator aborted (`ncclCommAbort` makes
//! the others' pending collectives return), the call returns the first error and the team refuses
//! later calls.
//!
//! **Memory.** Llama-3.1-70B in bf16 is 141.1 GB (131.4 GiB) of weights (70.55 B parameters): one
//! H200 (143771 MiB, about 139 GiB usable) holds them with some 7 GiB to spare for the CUDA context,
//! NCCL and cuDNN workspaces, activations and the KV cache (320 KiB per token over 80 layers), too
//! little to be worth it. Over two, each rank holds half the layers (68.5 GB), the whole 2.1 GB
//! embedding and half of `lm_head` (1.05 GB): 71.6 GB (66.7 GiB), leaving about 70 GiB per GPU.

mod load;
mod shard;
mod team;

pub use crate::nccl::rendezvous::RankEnv;
pub use load::{random_slice, WeightSource};
pub use shard::{Part, ShardPlan, Slice};
pub use team::{gathered_to_rows, Rank, TpLlama, TpOptions};
