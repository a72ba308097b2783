//! The hidden state between residual adds.

use crate::nccl::WindowBuf;
use cudnn_llm_ops::cudarc::driver::CudaSlice;

/// The residual stream `x`: two buffers, one current. An add reads the current one, writes the sum
/// into the other (the ops' residual epilogue reads and writes distinct buffers) and makes it current.
/// A tensor-parallel rank may also hold a smaller pair in its communicator's symmetric window
/// ([`crate::nccl::Comm::window_pair`]), which passes that fit use, so their all-reduces run NCCL's
/// symmetric kernels.
pub(crate) struct Residual<T> {
    bufs: [CudaSlice<T>; 2],
    window: Option<[WindowBuf<T>; 2]>,
    /// This pass runs in `window`.
    in_window: bool,
    current: usize,
}

impl<T> Residual<T> {
    pub(crate) fn new(a: CudaSlice<T>, b: CudaSlice<T>) -> Self {
        Residual { bufs: [a, b], window: None, in_window: false, current: 0 }
    }

    /// This stream with the window pair `window` for the passes it holds.
    pub(crate) fn with_window(self, window: Option<[WindowBuf<T>; 2]>) -> Self {
        Residual { window, ..self }
    }

    /// Whether this stream holds a window pair ([`Residual::with_window`]).
    pub(crate) fn has_window(&self) -> bool {
        self.window.is_some()
    }

    /// The buffer a pass of `elems` elements starts in (the embedding writes it); it becomes
    /// current: the window's first where the pass fits it, else the first of the plain pair.
    pub(crate) fn start(&mut self, elems: usize) -> &mut CudaSlice<T> {
        self.in_window = self.window.as_ref().is_some_and(|w| w[0].len() >= elems);
        self.current = 0;
        let [first, _] = self.pair();
        first
    }

    /// [`Residual::start`] in the plain pair (a pass that never all-reduces).
    pub(crate) fn first_mut(&mut self) -> &mut CudaSlice<T> {
        self.in_window = false;
        self.current = 0;
        &mut self.bufs[0]
    }

    /// The pair this pass runs in.
    fn pair(&mut self) -> [&mut CudaSlice<T>; 2] {
        match (&mut self.window, self.in_window) {
            (Some([a, b]), true) => [&mut **a, &mut **b],
            _ => {
                let [a, b] = &mut self.bufs;
                [a, b]
            }
        }
    }

    /// `x`.
    pub(crate) fn get(&self) -> &CudaSlice<T> {
        match (&self.window, self.in_window) {
            (Some(w), true) => &w[self.current],
            _ => &self.bufs[self.current],
        }
    }

    /// The x the last [`Residual::add`] read and the sum it wrote (now x), to complete that sum in
    /// place (a tensor-parallel rank's sum over the ranks).
    pub(crate) fn last_add(&mut self) -> (&CudaSlice<T>, &mut CudaSlice<T>) {
        let current = self.current;
        let [a, b] = self.pair();
        if current == 0 {
            (&*b, a)
        } else {
            (&*a, b)
        }
    }

    /// `x += f(x)`: `add(x, sum)` writes `x + f(x)` into `sum`, which becomes `x` when it succeeds
    /// (a tensor-parallel rank may complete `sum` later: [`Residual::last_add`]).
    pub(crate) fn add<E>(
        &mut self,
        add: impl FnOnce(&CudaSlice<T>, &mut CudaSlice<T>) -> Result<(), E>,
    ) -> Result<(), E> {
        let current = self.current;
        let [a, b] = self.pair();
        let (x, sum) = if current == 0 { (&*a, b) } else { (&*b, a) };
        add(x, sum)?;
        self.current = 1 - self.current;
        Ok(())
    }
}
