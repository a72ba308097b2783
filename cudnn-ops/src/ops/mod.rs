//! Fused ops: each builds (once, through the plan cache) a cuDNN graph and executes it.

pub mod epilogue;
pub mod loss;
pub mod matmul;
pub mod optim;
pub mod rmsnorm;
pub mod rope;
pub mod rows;
pub mod sdpa;
