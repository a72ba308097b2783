//! The hidden state between residual adds.

use cudnn_llm_ops::cudarc::driver::CudaSlice;

/// The residual stream `x`: two buffers, one current. An add reads the current one, writes the sum
/// into the other (the ops' residual epilogue reads and writes distinct buffers) and makes it current.
pub(crate) struct Residual<T> {
    bufs: [CudaSlice<T>; 2],
    current: usize,
}

impl<T> Residual<T> {
    pub(crate) fn new(a: CudaSlice<T>, b: CudaSlice<T>) -> Self {
        Residual { bufs: [a, b], current: 0 }
    }

    /// The buffer a pass starts in (the embedding writes it); it becomes current.
    pub(crate) fn first_mut(&mut self) -> &mut CudaSlice<T> {
        self.current = 0;
        &mut self.bufs[0]
    }

    /// `x`.
    pub(crate) fn get(&self) -> &CudaSlice<T> {
        &self.bufs[self.current]
    }

    /// `x += f(x)`: `add(x, sum)` writes `x + f(x)` into `sum`, which becomes `x` when it succeeds.
    pub(crate) fn add<E>(
        &mut self,
        add: impl FnOnce(&CudaSlice<T>, &mut CudaSlice<T>) -> Result<(), E>,
    ) -> Result<(), E> {
        let [a, b] = &mut self.bufs;
        let (x, sum) = if self.current == 0 { (&*a, b) } else { (&*b, a) };
        add(x, sum)?;
        self.current = 1 - self.current;
        Ok(())
    }
}
