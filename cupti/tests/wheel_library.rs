//! The real libcupti, where one can be found: `$CUPTI_TEST_LIBRARY`, else the wheel that
//! `cupti/regen.sh` unpacks (`~/.cache/cupti-sys/13.0.85/nvidia/cu13/lib/libcupti.so.13`). Without a GPU
//! driver the library still opens and reads its clock, but enabling activity fails; with one, a
//! collection with no launches yields no kernels. Either way: values or errors, never a panic.

use std::path::PathBuf;

fn wheel_library() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CUPTI_TEST_LIBRARY") {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("CUPTI_WHEEL_CACHE").map(PathBuf::from).or_else(|| {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("cupti-sys"))
    })?;
    let lib = cache.join("13.0.85/nvidia/cu13/lib/libcupti.so.13");
    lib.exists().then_some(lib)
}

#[test]
fn real_library_loads_or_fails_clearly() {
    let Some(path) = wheel_library() else {
        eprintln!("no libcupti to test (run cupti/regen.sh or set CUPTI_TEST_LIBRARY); skipped");
        return;
    };
    let cupti = match cudnn_llm_cupti::Cupti::load_from(std::slice::from_ref(&path)) {
        Ok(c) => c,
        Err(e) => {
            // E.g. a glibc too old for the wheel: the error must name the library.
            let msg = e.to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            eprintln!("libcupti did not load: {msg}");
            return;
        }
    };
    assert_eq!(cupti.library(), path.display().to_string());
    assert!(cupti.version() >= 130000, "{cupti:?}");
    let t0 = cudnn_llm_cupti::timestamp(&cupti).expect("cuptiGetTimestamp needs no GPU");
    let t1 = cupti.timestamp().unwrap();
    assert!(t0 > 0 && t1 >= t0, "{t0} {t1}");

    // Loading again reuses the open library.
    let again = cudnn_llm_cupti::Cupti::load_from(std::slice::from_ref(&path)).unwrap();
    assert_eq!(again.version(), cupti.version());

    assert_eq!(cupti.stop_and_collect(), Err(cudnn_llm_cupti::Error::NotStarted));
    match cupti.start() {
        Ok(()) => {
            // A GPU machine: nothing was launched, so no kernels; a second start is refused.
            assert_eq!(again.start(), Err(cudnn_llm_cupti::Error::AlreadyStarted));
            let c = cupti.stop_and_collect().unwrap();
            assert!(c.kernels.is_empty(), "{c:?}");
        }
        Err(e) => {
            // No driver here: cuptiActivityEnable fails (CUPTI_ERROR_UNKNOWN with libcupti 13.0.85).
            let cudnn_llm_cupti::Error::Call { function, name, .. } = &e else { panic!("{e:?}") };
            assert_eq!(*function, "cuptiActivityEnable", "{e}");
            assert!(name.starts_with("CUPTI_ERROR"), "{e}");
            eprintln!("start failed as expected without a GPU: {e}");
            // The failed start left nothing running: stop is refused, a new start fails the same way.
            assert_eq!(cupti.stop_and_collect(), Err(cudnn_llm_cupti::Error::NotStarted));
            let again = cupti.start().unwrap_err();
            assert!(
                matches!(again, cudnn_llm_cupti::Error::Call { function: "cuptiActivityEnable", .. }),
                "{again}"
            );
        }
    }
}
