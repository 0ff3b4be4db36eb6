//! How to write the external data file: the measurement behind `io::write_at_parallel`.
//!
//! `cargo bench --bench writers` (ORTCKPT_BENCH_GIB=4 for the throttled regime) writes
//! the same 32 MiB tensors to a new file five ways, five rounds in rotating order:
//! one sequential writer (the plain write() baseline), positioned writes from one and
//! two threads (ortckpt's writer), and a shared writable memory map filled from one
//! and two threads. Prints the median, range and throughput of each.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::time::Instant;

use memmap2::MmapMut;
use ortckpt::io::{write_at_parallel, AfterEachPiece, Progress};

fn sequential(path: &str, bufs: &[Vec<u8>]) {
    let mut f = File::create(path).unwrap();
    for b in bufs {
        f.write_all(b).unwrap();
    }
}

fn positioned(path: &str, bufs: &[Vec<u8>], threads: usize) {
    let f = File::create(path).unwrap();
    let mut values = Vec::new();
    let mut at = 0u64;
    for b in bufs {
        values.push((at, &b[..]));
        at += b.len() as u64;
    }
    let progress = Progress::default();
    let after = AfterEachPiece {
        writeback: false,
        progress: &progress,
    };
    write_at_parallel(&f, at, &values, threads, &after).unwrap();
}

fn mapped(path: &str, bufs: &[Vec<u8>], threads: usize) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap();
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    f.set_len(total as u64).unwrap();
    // SAFETY: the file was just created by this process and nothing else maps it.
    let mut map = unsafe { MmapMut::map_mut(&f).unwrap() };
    let mut rest: &mut [u8] = &mut map[..];
    let mut per_thread: Vec<Vec<(&mut [u8], &[u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, b) in bufs.iter().enumerate() {
        let (dst, tail) = rest.split_at_mut(b.len());
        per_thread[i % threads].push((dst, b));
        rest = tail;
    }
    std::thread::scope(|s| {
        for work in per_thread {
            s.spawn(move || {
                work.into_iter()
                    .for_each(|(dst, src)| dst.copy_from_slice(src))
            });
        }
    });
}

fn main() {
    let gib: usize = std::env::var("ORTCKPT_BENCH_GIB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let bufs: Vec<Vec<u8>> = (0..32 * gib)
        .map(|i| vec![(i % 251) as u8 + 1; 32 << 20])
        .collect();
    let dir = std::env::temp_dir().join(format!("ortckpt-writers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    type Strategy = (&'static str, fn(&str, &[Vec<u8>]));
    let strategies: [Strategy; 5] = [
        ("write() sequential", sequential),
        ("pwrite 1 thread", |p, b| positioned(p, b, 1)),
        ("pwrite 2 threads", |p, b| positioned(p, b, 2)),
        ("mmap 1 thread", |p, b| mapped(p, b, 1)),
        ("mmap 2 threads", |p, b| mapped(p, b, 2)),
    ];
    let mut times = vec![Vec::new(); strategies.len()];
    for round in 0..5 {
        for k in 0..strategies.len() {
            let k = (k + round) % strategies.len();
            let path = dir.join("out.bin");
            let _ = std::fs::remove_file(&path);
            let start = Instant::now();
            (strategies[k].1)(path.to_str().unwrap(), &bufs);
            times[k].push(start.elapsed().as_secs_f64());
            let _ = std::fs::remove_file(&path);
        }
    }
    println!("{gib} GiB in 32 MiB tensors, 5 rounds, new file each time:");
    for (k, (name, _)) in strategies.iter().enumerate() {
        let mut t = times[k].clone();
        t.sort_by(|a, b| a.total_cmp(b));
        println!(
            "  {name:20} median {:.3} s ({:.2} GiB/s), range {:.3}-{:.3} s",
            t[2],
            gib as f64 / t[2],
            t[0],
            t[4]
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
