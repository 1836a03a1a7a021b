//! Finds libminikv for linking, without crates.io helpers:
//! 1. the `pkg-config` program (`pkg-config --libs-only-L minikv`, `--libs-only-l`,
//!    `--cflags-only-I`), unless MINIKV_NO_PKG_CONFIG is set;
//! 2. else MINIKV_LIB_DIR, a directory holding libminikv.so (a build tree or a libdir).
//!
//! When neither finds it, the build stops with a message that says what to do.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

// The oldest library these bindings can use: the version of the include/minikv.h they were
// generated from, which is the crate's own (scripts/version.sh keeps the two equal).
const MIN_VERSION: &str = env!("CARGO_PKG_VERSION");

fn main() {
    for var in [
        "MINIKV_LIB_DIR",
        "MINIKV_NO_PKG_CONFIG",
        "PKG_CONFIG",
        "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR",
        "PKG_CONFIG_SYSROOT_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    let mut pkg_config_error = String::from("skipped (MINIKV_NO_PKG_CONFIG is set)");
    if env::var_os("MINIKV_NO_PKG_CONFIG").is_none() {
        match from_pkg_config() {
            Ok(()) => return,
            Err(e) => pkg_config_error = e,
        }
    }
    if let Some(dir) = env::var_os("MINIKV_LIB_DIR") {
        from_lib_dir(Path::new(&dir));
        return;
    }
    panic!(
        "\n\nminikv-sys: cannot find libminikv.\n  pkg-config: {pkg_config_error}\n  \
         MINIKV_LIB_DIR: not set\nInstall libminikv (cmake --install; its minikv.pc must be on \
         PKG_CONFIG_PATH), or set MINIKV_LIB_DIR to the directory holding libminikv.so \
         (e.g. a CMake build directory), and LD_LIBRARY_PATH to the same directory to run.\n\n"
    );
}

fn pkg_config(args: &[&str]) -> Result<String, String> {
    let program = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into());
    let out = Command::new(&program)
        .args(args)
        .output()
        .map_err(|e| format!("could not run `{program}`: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!("`{program} {}` failed: {}", args.join(" "), stderr.trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn from_pkg_config() -> Result<(), String> {
    let spec = format!("minikv >= {MIN_VERSION}");
    pkg_config(&["--exists", "--print-errors", &spec])?;
    for flag in pkg_config(&["--libs-only-L", "minikv"])?.split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
        }
    }
    let mut linked = false;
    for flag in pkg_config(&["--libs-only-l", "minikv"])?.split_whitespace() {
        if let Some(lib) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib={lib}");
            linked |= lib == "minikv";
        }
    }
    if !linked {
        println!("cargo:rustc-link-lib=minikv");
    }
    // Exposed to dependents' build scripts as DEP_MINIKV_INCLUDE (links = "minikv").
    for flag in pkg_config(&["--cflags-only-I", "minikv"])?.split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-I") {
            println!("cargo:include={dir}");
        }
    }
    Ok(())
}

fn from_lib_dir(dir: &Path) {
    let names = ["libminikv.so", "libminikv.dylib", "minikv.lib", "libminikv.a"];
    if !names.iter().any(|n| dir.join(n).exists()) {
        panic!(
            "\n\nminikv-sys: MINIKV_LIB_DIR is {} but it holds none of {names:?}; point it at \
             the directory where libminikv was built or installed.\n\n",
            dir.display()
        );
    }
    let dir: PathBuf = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=minikv");
    println!("cargo:lib_dir={}", dir.display());
}
