//! Per-call bookkeeping of a forward: which backend a module call runs on, the observer's range around
//! it, and fused calls that cuDNN cannot run falling back to naive kernels.

use crate::backends::{Backends, Site};
use crate::{Backend, Result};
use std::collections::HashSet;

/// Called around every module call, for profilers (CUDA events, NVTX, kernel attribution).
pub trait Observer {
    /// A module call begins: its range name (e.g. `fwd.layer.attn.gqa`) and layer.
    fn begin(&mut self, _range: &'static str, _layer: Option<usize>) {}
    /// The call ends (its work is enqueued).
    fn end(&mut self, _range: &'static str, _layer: Option<usize>) {}
}

/// An observer that does nothing.
pub struct NoObserver;
impl Observer for NoObserver {}

/// A fused module that ran naive instead.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Fallback {
    /// Range name of the module.
    pub range: &'static str,
    /// Its layer.
    pub layer: Option<usize>,
    /// The shape it failed for.
    pub shape: String,
    /// cuDNN's reason.
    pub reason: String,
}

/// The model's record of fallbacks: each one once, and the (range, layer, shape) keys not to retry.
#[derive(Debug, Default)]
pub(crate) struct Fallbacks {
    pub(crate) list: Vec<Fallback>,
    unsupported: HashSet<(&'static str, Option<usize>, String)>,
}

/// One forward's dispatch of module calls to backends, with its observer and the model's fallbacks.
pub(crate) struct Dispatch<'a> {
    fallbacks: &'a mut Fallbacks,
    backends: &'a Backends,
    obs: &'a mut dyn Observer,
}

impl<'a> Dispatch<'a> {
    pub(crate) fn new(
        fallbacks: &'a mut Fallbacks,
        backends: &'a Backends,
        obs: &'a mut dyn Observer,
    ) -> Self {
        Dispatch { fallbacks, backends, obs }
    }

    /// The backend [`Backends`] selects for `site` of `layer` (before any fallback).
    pub(crate) fn backend(&self, site: Site, layer: Option<usize>) -> Backend {
        self.backends.get(layer, site.kind)
    }

    /// Runs `launch` inside `range`'s observer range (for a module with one backend: the embedding).
    pub(crate) fn observe<R>(
        &mut self,
        range: &'static str,
        layer: Option<usize>,
        launch: impl FnOnce() -> R,
    ) -> R {
        self.obs.begin(range, layer);
        let result = launch();
        self.obs.end(range, layer);
        result
    }

    /// Runs the module call at `site` of `layer`: `launch` enqueues its work on the backend it is
    /// given, which is the one [`Backends`] selects. A fused `NotSupported` is recorded once per
    /// shape, and the call (and later ones of that shape) runs naive; other errors are returned.
    pub(crate) fn run(
        &mut self,
        site: Site,
        layer: Option<usize>,
        shape: &str,
        mut launch: impl FnMut(Backend) -> cudnn_llm_ops::Result<()>,
    ) -> Result<()> {
        let Site { range, kind } = site;
        self.obs.begin(range, layer);
        let mut backend = self.backends.get(layer, kind);
        let key = (range, layer, shape.to_string());
        if backend == Backend::Fused && self.fallbacks.unsupported.contains(&key) {
            backend = Backend::Naive;
        }
        let result = match launch(backend) {
            Err(e) if backend == Backend::Fused && e.is_not_supported() => {
                let reason = e.to_string();
                self.fallbacks.list.push(Fallback { range, layer, shape: shape.to_string(), reason });
                self.fallbacks.unsupported.insert(key);
                launch(Backend::Naive)
            }
            other => other,
        };
        self.obs.end(range, layer);
        Ok(result?)
    }

    /// Runs a module call made of several op calls (a module's backward) at `site` of `layer`,
    /// inside the site's range: `body` runs each op through [`Ops::run`], on the backend
    /// [`Backends`] selects. A fused op that cuDNN cannot run runs naive on its own, and is recorded
    /// as the module's fallback for `shape` (once); the module's later ops, and its later calls of
    /// that shape, run naive. Unlike [`Dispatch::run`], nothing is run twice: an op refuses before it
    /// writes, but the ops before it have run, and some add to gradient buffers.
    pub(crate) fn run_each(
        &mut self,
        site: Site,
        layer: Option<usize>,
        shape: &str,
        body: impl FnOnce(&mut Ops<'_>) -> Result<()>,
    ) -> Result<()> {
        let Site { range, kind } = site;
        self.obs.begin(range, layer);
        let mut backend = self.backends.get(layer, kind);
        let key = (range, layer, shape.to_string());
        if backend == Backend::Fused && self.fallbacks.unsupported.contains(&key) {
            backend = Backend::Naive;
        }
        let mut ops = Ops { backend, fallbacks: &mut *self.fallbacks, key };
        let result = body(&mut ops);
        self.obs.end(range, layer);
        result
    }
}

/// The op calls of one module call ([`Dispatch::run_each`]): the backend they run on, and where a
/// fused op that falls back is recorded.
pub(crate) struct Ops<'a> {
    backend: Backend,
    fallbacks: &'a mut Fallbacks,
    key: (&'static str, Option<usize>, String),
}

impl Ops<'_> {
    /// The backend the module's next op runs on.
    pub(crate) fn backend(&self) -> Backend {
        self.backend
    }

    /// Runs one op call on the module's backend; a fused `NotSupported` is recorded (the module's
    /// first only) and the op, and every later one of the module, runs naive.
    pub(crate) fn run(&mut self, mut launch: impl FnMut(Backend) -> cudnn_llm_ops::Result<()>) -> Result<()> {
        match launch(self.backend) {
            Err(e) if self.backend == Backend::Fused && e.is_not_supported() => {
                let (range, layer, shape) = self.key.clone();
                if self.fallbacks.unsupported.insert(self.key.clone()) {
                    self.fallbacks.list.push(Fallback { range, layer, shape, reason: e.to_string() });
                }
                self.backend = Backend::Naive;
                Ok(launch(Backend::Naive)?)
            }
            other => Ok(other?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// Records which ranges opened and closed.
    #[derive(Default)]
    struct Log(Vec<String>);
    impl Observer for Log {
        fn begin(&mut self, range: &'static str, layer: Option<usize>) {
            self.0.push(format!("+{range}@{layer:?}"));
        }
        fn end(&mut self, range: &'static str, layer: Option<usize>) {
            self.0.push(format!("-{range}@{layer:?}"));
        }
    }

    #[test]
    fn unsupported_fused_modules_fall_back_once_per_shape_and_say_why() {
        let (mut fallbacks, mut log) = (Fallbacks::default(), Log::default());
        let backends = Backends::all(Backend::Fused);
        let mut tried = Vec::new();
        let not_supported =
            || cudnn_llm_ops::Error::NotSupported { op: "sdpa".into(), reason: "head_dim 264".into() };
        for _ in 0..2 {
            let mut dispatch = Dispatch::new(&mut fallbacks, &backends, &mut log);
            dispatch
                .run(Site::GQA, Some(3), "1x8 causal", |b| {
                    tried.push(b);
                    if b == Backend::Fused {
                        Err(not_supported())
                    } else {
                        Ok(())
                    }
                })
                .unwrap();
        }
        // Fused once, naive twice; one record; ranges balanced.
        assert_eq!(tried, vec![Backend::Fused, Backend::Naive, Backend::Naive]);
        assert_eq!(fallbacks.list.len(), 1);
        let f = &fallbacks.list[0];
        assert_eq!((f.range, f.layer, f.shape.as_str()), ("fwd.layer.attn.gqa", Some(3), "1x8 causal"));
        assert!(f.reason.contains("head_dim 264"), "{}", f.reason);
        assert_eq!(
            log.0,
            [
                "+fwd.layer.attn.gqa@Some(3)",
                "-fwd.layer.attn.gqa@Some(3)",
                "+fwd.layer.attn.gqa@Some(3)",
                "-fwd.layer.attn.gqa@Some(3)"
            ]
        );
        // Another error is not a fallback: it is returned, and the range still closes.
        let mut dispatch = Dispatch::new(&mut fallbacks, &backends, &mut log);
        let e = dispatch.run(Site::ROPE, Some(0), "8 tokens", |_| {
            Err(cudnn_llm_ops::Error::InvalidArgument("bad".into()))
        });
        assert!(matches!(e, Err(Error::Ops(cudnn_llm_ops::Error::InvalidArgument(_)))));
        assert_eq!(log.0.last().unwrap(), "-fwd.layer.attn.rope@Some(0)");
        assert_eq!(fallbacks.list.len(), 1);
        // A naive selection never tries fused; the site's kind picks the backend.
        let naive = Backends::all(Backend::Fused).with(crate::ModuleKind::Prenorm, Backend::Naive);
        let mut dispatch = Dispatch::new(&mut fallbacks, &naive, &mut log);
        let mut seen = Vec::new();
        dispatch
            .run(Site::MLP_PRENORM, Some(0), "8 tokens", |b| {
                seen.push(b);
                Ok(())
            })
            .unwrap();
        dispatch
            .run(Site::MLP, Some(0), "8 tokens", |b| {
                seen.push(b);
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, vec![Backend::Naive, Backend::Fused]);
        assert_eq!(log.0.last().unwrap(), "-fwd.layer.mlp.mlp@Some(0)");
        // A kind-less range (the embedding) opens and closes around its launch.
        let mut dispatch = Dispatch::new(&mut fallbacks, &naive, &mut log);
        assert_eq!(dispatch.observe("fwd.embed", None, || 7), 7);
        assert_eq!(log.0[log.0.len() - 2..], ["+fwd.embed@None", "-fwd.embed@None"]);
    }

    #[test]
    fn a_module_of_several_ops_falls_back_op_by_op_without_running_any_twice() {
        let (mut fallbacks, mut log) = (Fallbacks::default(), Log::default());
        let backends = Backends::all(Backend::Fused);
        let not_supported = || cudnn_llm_ops::Error::NotSupported { op: "mlp".into(), reason: "no".into() };
        let site = Site::MLP.backward();
        // Op 0 runs fused, op 1 refuses fused and runs naive, op 2 runs naive: each op's work once.
        let mut ran = Vec::new();
        let mut dispatch = Dispatch::new(&mut fallbacks, &backends, &mut log);
        dispatch
            .run_each(site, Some(1), "64 tokens", |ops| {
                for op in 0..3 {
                    ops.run(|b| {
                        if op == 1 && b == Backend::Fused {
                            return Err(not_supported());
                        }
                        ran.push((op, b));
                        Ok(())
                    })?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(ran, vec![(0, Backend::Fused), (1, Backend::Naive), (2, Backend::Naive)]);
        assert_eq!(fallbacks.list.len(), 1);
        let f = &fallbacks.list[0];
        assert_eq!((f.range, f.layer, f.shape.as_str()), ("bwd.layer.mlp.mlp", Some(1), "64 tokens"));
        assert_eq!(log.0, ["+bwd.layer.mlp.mlp@Some(1)", "-bwd.layer.mlp.mlp@Some(1)"]);
        // The next call of that shape starts naive; another layer starts fused; errors pass through
        // and the range still closes.
        let mut seen = Vec::new();
        let mut dispatch = Dispatch::new(&mut fallbacks, &backends, &mut log);
        for layer in [1, 2] {
            dispatch
                .run_each(site, Some(layer), "64 tokens", |ops| {
                    seen.push(ops.backend());
                    Ok(())
                })
                .unwrap();
        }
        assert_eq!(seen, vec![Backend::Naive, Backend::Fused]);
        let e = dispatch.run_each(site, Some(0), "64 tokens", |ops| {
            ops.run(|_| Err(cudnn_llm_ops::Error::InvalidArgument("bad".into())))
        });
        assert!(matches!(e, Err(Error::Ops(cudnn_llm_ops::Error::InvalidArgument(_)))));
        assert_eq!(log.0.last().unwrap(), "-bwd.layer.mlp.mlp@Some(0)");
        assert_eq!(fallbacks.list.len(), 1);
    }
}
