//! What `build.rs` found under `src/`: the kernel sources and the plan-lowering sources.

include!(concat!(env!("OUT_DIR"), "/sources.rs"));
