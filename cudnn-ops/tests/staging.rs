//! Uploads through the pinned staging buffers land every byte where it belongs: parts of odd sizes
//! across the buffers' edges, many turns of small buffers, large parts filled on several threads, and
//! the uploader dropped while its copies may still run.

use cudnn_llm_ops::half::bf16;
use cudnn_llm_ops::reference;
use cudnn_llm_ops::{Cudnn, Uploader};

fn values(seed: u64, n: usize) -> Vec<bf16> {
    reference::random_values(seed, n).iter().map(|&v| bf16::from_f64(v)).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn uploads_hold_their_parts_in_order() {
    let ctx = Cudnn::new(0).unwrap();
    let parts = [values(1, 3), values(2, 0), values(3, 2047), values(4, 2049), values(5, 1)];
    let refs: Vec<&[bf16]> = parts.iter().map(|p| &p[..]).collect();
    let want = parts.concat();
    for stage in [4096, 6000, 1 << 20] {
        let mut up = Uploader::new(&ctx, stage).unwrap();
        let dev = up.upload(&ctx, &refs).unwrap();
        assert_eq!(ctx.stream().clone_dtoh(&dev).unwrap(), want, "stage {stage}");
        // A second upload through the same buffers, then the uploader dropped before reading.
        let again = up.upload(&ctx, &refs[2..]).unwrap();
        drop(up);
        assert_eq!(ctx.stream().clone_dtoh(&again).unwrap(), parts[2..].concat(), "stage {stage}, again");
    }
    // 48 MB of f32 in two parts through the default 64 MiB buffers (filled on several threads), and
    // through 4 MiB ones (12 turns, the two buffers alternating).
    let big: Vec<f32> = reference::random_values(6, 12 << 20).iter().map(|&v| v as f32).collect();
    let (a, b) = big.split_at(5 << 20);
    for stage in [cudnn_llm_ops::staging::DEFAULT_STAGE_BYTES, 4 << 20] {
        let mut up = Uploader::new(&ctx, stage).unwrap();
        let dev = up.upload(&ctx, &[a, b]).unwrap();
        drop(up);
        assert!(ctx.stream().clone_dtoh(&dev).unwrap() == big, "48 MB through {stage}-byte buffers");
    }
    let mut up = Uploader::new(&ctx, 4096).unwrap();
    assert_eq!(up.upload::<f32>(&ctx, &[]).unwrap().len(), 0);
}
