//! Greedy decoding on the device: the argmax of each row of `logits [rows, vocab]` (bf16, f16 or f32),
//! ties to the lowest id, in one launch (a block per row, `argmax.cu`), so that a decode step picks
//! its next id without copying the logits to the host, and a captured step can feed the id straight
//! into the next step's input ([`ArgmaxOperands::ids`]).
//!
//! Each row gives one `u32` *pick word* ([`Pick::from_word`]): the id, or what makes the row
//! unsampleable (a NaN or +∞ at its first such id, or every logit −∞) — the checks of a host argmax,
//! reported per row instead of as an error, because a launch (possibly inside a CUDA graph) cannot
//! return one. The host reads the words when it needs the ids and turns a bad one into its error.
//! Like the other row moves it has one implementation, so the call takes no
//! [`Backend`](crate::Backend).

use crate::checked;
use crate::dtype::{DataType, Element};
use crate::error::ensure;
use crate::kernels::{launch, optional_ptr_mut, Arg, Kernels};
use crate::{Cudnn, Result};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

/// Vocabularies up to this size (exclusive) fit a pick word (ids below 2^30; two flag bits above).
pub const MAX_VOCAB: usize = 1 << 30;

const BROKEN: u32 = 0x8000_0000;
const INF: u32 = 0x4000_0000;
const MASKED: u32 = u32::MAX;

/// Threads per row block.
const THREADS: u32 = 1024;

/// What the argmax of one row found, decoded from its pick word.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pick {
    /// The id of the largest logit (the lowest such id on ties).
    Id(u32),
    /// The row holds NaN or +∞; `id` is the first such id and `value` which of the two it is.
    Broken {
        /// The first id holding NaN or +∞.
        id: u32,
        /// `f32::NAN` or `f32::INFINITY`.
        value: f32,
    },
    /// Every logit of the row is −∞.
    Masked,
}

impl Pick {
    /// Decodes a pick word written by [`argmax`].
    pub fn from_word(word: u32) -> Pick {
        match word {
            MASKED => Pick::Masked,
            w if w & BROKEN != 0 => {
                let value = if w & INF != 0 { f32::INFINITY } else { f32::NAN };
                Pick::Broken { id: w & (INF - 1), value }
            }
            w => Pick::Id(w),
        }
    }

    /// The pick word of this pick (the encoding [`argmax`] writes; the CPU reference builds its
    /// words with it).
    pub fn word(self) -> u32 {
        match self {
            Pick::Id(id) => id,
            Pick::Broken { id, value } => BROKEN | if value.is_nan() { 0 } else { INF } | id,
            Pick::Masked => MASKED,
        }
    }
}

/// Shape of an argmax call: `rows` rows of `vocab` logits, `row_stride` elements apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ArgmaxArgs {
    /// Rows (one pick each).
    pub rows: usize,
    /// Logits per row.
    pub vocab: usize,
    /// Elements from one row's start to the next (at least `vocab`).
    pub row_stride: usize,
}

impl ArgmaxArgs {
    /// `rows` packed rows of `vocab` logits.
    pub fn new(rows: usize, vocab: usize) -> Self {
        ArgmaxArgs { rows, vocab, row_stride: vocab }
    }

    /// The same with rows `row_stride` elements apart.
    pub fn with_row_stride(self, row_stride: usize) -> Self {
        ArgmaxArgs { row_stride, ..self }
    }

    /// Checks the shape against the buffer lengths (logits, picks, and the ids when given) with
    /// checked arithmetic (no GPU needed).
    pub fn check(&self, logits: usize, picks: usize, ids: Option<usize>) -> Result<()> {
        let ArgmaxArgs { rows, vocab, row_stride } = *self;
        ensure!(rows > 0 && vocab > 0, "argmax: empty shape {self:?}");
        ensure!(vocab < MAX_VOCAB, "argmax: a vocabulary of {vocab} does not fit a pick word (< 2^30)");
        ensure!(row_stride >= vocab, "argmax: row stride {row_stride} < vocabulary {vocab}");
        let last = checked::mul("argmax: (rows - 1) * row_stride", rows - 1, row_stride)?;
        let need =
            checked::fits_i64("argmax: logits extent", checked::add("argmax: logits extent", last, vocab)?)?;
        ensure!(logits >= need, "argmax: logits have {logits} elements, need {need}");
        ensure!(picks >= rows, "argmax: {picks} picks for {rows} rows");
        if let Some(ids) = ids {
            ensure!(ids >= rows, "argmax: {ids} ids for {rows} rows");
        }
        Ok(())
    }
}

/// The buffers of an argmax call.
#[non_exhaustive]
pub struct ArgmaxOperands<'a, T: Element> {
    /// `[rows, vocab]` logits (rows [`ArgmaxArgs::row_stride`] apart), read.
    pub logits: &'a dyn DevicePtr<T>,
    /// One pick word per row ([`Pick::from_word`]), written.
    pub picks: &'a mut dyn DevicePtrMut<u32>,
    /// Where the ids go as well when given (e.g. the next decode step's input ids): the argmax of
    /// each row, a valid id even for a row whose pick is not [`Pick::Id`].
    pub ids: Option<&'a mut dyn DevicePtrMut<u32>>,
}

impl<'a, T: Element> ArgmaxOperands<'a, T> {
    /// `logits` in, one pick word per row into `picks`.
    pub fn new(logits: &'a dyn DevicePtr<T>, picks: &'a mut dyn DevicePtrMut<u32>) -> Self {
        ArgmaxOperands { logits, picks, ids: None }
    }

    /// The ids into `ids` as well (see [`ArgmaxOperands::ids`](#structfield.ids)).
    pub fn ids(mut self, ids: &'a mut dyn DevicePtrMut<u32>) -> Self {
        self.ids = Some(ids);
        self
    }
}

fn suffix(dtype: DataType) -> Result<&'static str> {
    crate::kernels::float_suffix("argmax", "logits", dtype)
}

/// The argmax of each row of `logits` into `picks` (and `ids` when given), one launch of a block per
/// row; launch-only, so it can be captured in a CUDA graph. Read the words back with
/// [`Pick::from_word`].
pub fn argmax<T: Element>(ctx: &Cudnn, args: ArgmaxArgs, x: ArgmaxOperands<'_, T>) -> Result<()> {
    let sfx = suffix(T::DTYPE)?;
    let ArgmaxOperands { logits, picks, ids } = x;
    args.check(logits.len(), picks.len(), ids.as_ref().map(|i| i.len()))?;
    let ArgmaxArgs { rows, vocab, row_stride } = args;
    let kernels = Kernels::get(ctx)?;
    let cfg = LaunchConfig {
        grid_dim: (checked::launch_dim("argmax: rows", rows)?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let s = ctx.stream();
    let (l, _gl) = logits.device_ptr(s);
    let (p, _gp) = picks.device_ptr_mut(s);
    let (i, _gi) = optional_ptr_mut(ids, s);
    // vocab and row_stride were checked to fit i64 (below the logits extent).
    let args = [Arg::Ptr(l), Arg::I64(vocab as i64), Arg::I64(row_stride as i64), Arg::Ptr(p), Arg::Ptr(i)];
    launch(ctx, kernels, &format!("argmax_{sfx}"), cfg, &args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn shapes_and_lengths_are_checked() {
        let a = ArgmaxArgs::new(3, 10);
        a.check(30, 3, Some(3)).unwrap();
        a.with_row_stride(16).check(2 * 16 + 10, 3, None).unwrap();
        for (bad, (l, p, i), expected) in [
            (a, (29, 3, None), "logits have 29"),
            (a, (30, 2, None), "2 picks for 3"),
            (a, (30, 3, Some(2)), "2 ids for 3"),
            (ArgmaxArgs::new(0, 10), (30, 3, None), "empty shape"),
            (ArgmaxArgs::new(1, MAX_VOCAB), (usize::MAX, 3, None), "pick word"),
            (a.with_row_stride(9), (30, 3, None), "row stride 9"),
            (a.with_row_stride(1 << 62), (usize::MAX, 3, None), "64-bit signed"),
            (a.with_row_stride(usize::MAX / 2 + 1), (usize::MAX, 3, None), "overflows"),
        ] {
            let e = bad.check(l, p, i).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(expected),
                "{expected}: {e}"
            );
        }
        assert!(suffix(DataType::I32).unwrap_err().is_not_supported());
    }

    #[test]
    fn pick_words_round_trip() {
        for p in [
            Pick::Id(0),
            Pick::Id(128_255),
            Pick::Id((MAX_VOCAB - 1) as u32),
            Pick::Broken { id: 7, value: f32::INFINITY },
            Pick::Masked,
        ] {
            assert_eq!(Pick::from_word(p.word()), p);
        }
        match Pick::from_word(Pick::Broken { id: 3, value: f32::NAN }.word()) {
            Pick::Broken { id: 3, value } => assert!(value.is_nan()),
            other => panic!("{other:?}"),
        }
    }
}
