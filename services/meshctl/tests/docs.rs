//! The docs cannot drift from the binaries: every flag that a binary's
//! `--help` prints (for each subcommand its `--help` lists too) is
//! documented in its page under docs/reference/. Runs the real binaries of
//! this build. And the README, the front door, stays under 8 KB.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// (binary, the page that documents it). Subcommands come from `--help`.
const BINARIES: &[(&str, &str)] = &[
    ("meshctl", "meshctl.md"),
    ("pdmesh-bench", "bench.md"),
    ("pdmesh-engine", "engine.md"),
    ("pdmesh-loadtest", "loadtest.md"),
    ("pdmesh-gateway", "services.md"),
    ("pdmesh-router", "services.md"),
    ("pdmesh-tokenizer", "services.md"),
    ("pdmesh-kvbroker", "services.md"),
    ("pdmesh-prefill", "services.md"),
    ("pdmesh-decode", "services.md"),
];

/// The subcommands a `--help` text lists under `Commands:` (not `help`).
fn subcommands(help: &str) -> Vec<String> {
    let Some((_, rest)) = help.split_once("Commands:\n") else { return Vec::new() };
    rest.lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

fn bin_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_meshctl")).parent().expect("target folder").to_path_buf()
}

fn reference(page: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/reference").join(page);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The long flags on the option lines of a `--help` text.
fn flags(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in help.lines().map(str::trim_start).filter(|l| l.starts_with('-')) {
        let Some(at) = line.find("--") else { continue };
        let name: String = line[at + 2..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
        if !name.is_empty() && name != "help" && name != "version" {
            out.push(format!("--{name}"));
        }
    }
    out
}

/// `flag` appears in `doc` as a whole flag (not as the start of a longer one).
fn documented(doc: &str, flag: &str) -> bool {
    doc.match_indices(flag).any(|(i, _)| {
        let next = doc[i + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

fn help(bin: &Path, sub: Option<&str>) -> String {
    let mut c = Command::new(bin);
    c.args(sub).arg("--help");
    let out = c.output().unwrap_or_else(|e| {
        panic!("{}: {e} (build the workspace first: cargo build --release --workspace)", bin.display())
    });
    assert!(out.status.success(), "{} {sub:?} --help failed", bin.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_flag_in_help_is_in_the_reference_docs() {
    let dir = bin_dir();
    let mut missing = Vec::new();
    let mut checked = 0;
    for (name, page) in BINARIES {
        let doc = reference(page);
        let bin = dir.join(name);
        let top = help(&bin, None);
        let subs = subcommands(&top);
        let mut helps = vec![(String::new(), top)];
        helps.extend(subs.iter().map(|s| (format!(" {s}"), help(&bin, Some(s)))));
        for (sub, text) in helps {
            for flag in flags(&text) {
                checked += 1;
                if !documented(&doc, &flag) {
                    missing.push(format!("{name}{sub} {flag} (docs/reference/{page})"));
                }
            }
        }
    }
    assert!(checked > 100, "only {checked} flags found: is the --help parsing broken?");
    assert!(missing.is_empty(), "flags missing from the docs:\n  {}", missing.join("\n  "));
}

#[test]
fn the_flag_reader_finds_long_flags_only_on_option_lines() {
    let help = "Usage: x [OPTIONS]\n\nOptions:\n      --listen <LISTEN>  gRPC address [env: X=]\n  -m, --model <M>\n  \
                see --not-an-option here\n  -h, --help\n";
    assert_eq!(flags(help), vec!["--listen", "--model"]);
    assert!(documented("| `--model` | x |", "--model"));
    assert!(!documented("| `--model-b` | x |", "--model"));
    let top =
        "Usage: x <COMMAND>\n\nCommands:\n  up     Start\n  scale  Change\n  help   Print\n\nOptions:\n  -h, --help\n";
    assert_eq!(subcommands(top), vec!["up", "scale"]);
}

/// The README is the front door: set-up, status and where to read on.
/// Details belong in docs/.
#[test]
fn the_readme_stays_under_8_kb() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let n = std::fs::metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).len();
    assert!(n <= 8192, "README.md is {n} bytes; keep it at most 8192 (move details to docs/)");
}
