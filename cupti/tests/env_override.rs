//! `CUPTI_LIBRARY` names the one library to open. Alone in its test binary: it sets the variable.

#[test]
fn env_override_names_the_path_in_the_error() {
    // Edition 2021: `set_var` is safe; no other test in this process reads the environment.
    std::env::set_var(cudnn_llm_cupti::LIBRARY_ENV, "/nonexistent/libcupti.so.13");
    assert_eq!(
        cudnn_llm_cupti::default_candidates(),
        [std::path::PathBuf::from("/nonexistent/libcupti.so.13")]
    );
    let err = cudnn_llm_cupti::Cupti::load().unwrap_err();
    let cudnn_llm_cupti::Error::NotFound { tried } = &err else { panic!("{err:?}") };
    assert_eq!(tried.len(), 1);
    assert_eq!(tried[0].name, "/nonexistent/libcupti.so.13");
    let msg = err.to_string();
    assert!(msg.contains("/nonexistent/libcupti.so.13"), "{msg}");
    assert!(msg.contains("CUPTI_LIBRARY"), "{msg}");
    std::env::remove_var(cudnn_llm_cupti::LIBRARY_ENV);
}
