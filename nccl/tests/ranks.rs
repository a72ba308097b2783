//! Ranks as processes, on the GPU: each rank makes its own communicator from a unique id rank 0 sends
//! over the TCP rendezvous (threads stand in for the processes here; `app/tests/launch.rs` checks the
//! launcher with real processes). Needs two GPUs; skips with a message on fewer.

use cudnn_llm_nccl::rendezvous::Session;
use cudnn_llm_nccl::{Comm, NcclConfig, UniqueId};
use cudnn_llm_ops::testing::gpus_or_skip;
use cudnn_llm_ops::Cudnn;
use std::time::Duration;

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_ranks_joined_through_the_rendezvous_all_reduce() {
    if !gpus_or_skip(2, "two_ranks_joined_through_the_rendezvous_all_reduce") {
        return;
    }
    // NCCL's settings before any thread: `Comm::init_rank` then finds them set and sets nothing while
    // the other rank's NCCL may read the environment.
    for (name, value) in
        [("NCCL_NVLS_ENABLE", "0"), ("NCCL_RUNTIME_CONNECT", "0"), ("NCCL_GRAPH_MIXING_SUPPORT", "0")]
    {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    // A rank that fails leaves the other in NCCL's init: end the test rather than hang the suite.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(180));
        eprintln!("two_ranks_joined_through_the_rendezvous_all_reduce: no result in 180 s");
        std::process::exit(1);
    });
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let rank = |r: usize, session: Session| {
        let id = UniqueId::from_bytes(session.payload()).unwrap();
        let ctx = Cudnn::new(r).unwrap();
        let comm = Comm::init_rank(r, r, 2, &id, &NcclConfig::default()).unwrap();
        assert_eq!((comm.rank(), comm.ranks(), comm.device()), (r, 2, r));
        let host: Vec<f32> = (0..1000).map(|i| (i * (r + 1)) as f32 + 0.5).collect();
        let mut buf = ctx.stream().clone_htod(&host).unwrap();
        comm.all_reduce_sum(ctx.stream(), &mut buf).unwrap();
        let got = ctx.stream().clone_dtoh(&buf).unwrap();
        for (i, v) in got.iter().enumerate() {
            assert_eq!(*v, (i * 3) as f32 + 1.0, "element {i} on rank {r}");
        }
        drop(comm);
        session.finish();
    };
    let t = Duration::from_secs(60);
    let one =
        std::thread::spawn(move || rank(1, Session::connect("127.0.0.1", port, 1, 2, "test", t).unwrap()));
    let zero = Session::serve(listener, 2, "test", t, || {
        Ok(UniqueId::new().map_err(|e| e.to_string())?.as_bytes().to_vec())
    })
    .unwrap();
    rank(0, zero);
    one.join().unwrap();
}

#[test]
fn a_unique_id_is_128_bytes_and_a_rank_is_below_the_count() {
    assert!(UniqueId::from_bytes(&[0; 127]).unwrap_err().to_string().contains("128 bytes, not 127"));
    let id = UniqueId::from_bytes(&[7; 128]).unwrap();
    assert_eq!(id.as_bytes(), &[7; 128][..]);
    assert_eq!(format!("{id:?}"), "UniqueId(..)");
    // Refused before any library is opened or GPU touched.
    let e = Comm::init_rank(0, 2, 2, &id, &NcclConfig::default()).err().unwrap().to_string();
    assert!(e.contains("rank 2 of 2"), "{e}");
}
