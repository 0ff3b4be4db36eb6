use super::floats::*;
use super::*;

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn run_memory(
    operation: &Operation,
    data_type: DataType,
    sources: &[Vec<u8>],
) -> (Vec<u8>, Option<Overflow>) {
    let mut out = vec![0xAAu8; sources[0].len()];
    let mut jobs = [Job {
        data_type,
        inputs: sources
            .iter()
            .map(|s| Input {
                bytes: s,
                release: None,
            })
            .collect(),
        sink: Sink::Memory(&mut out),
    }];
    let mut chunks = 0;
    let outcome = run(operation, &mut jobs, 2, &mut |_| {
        chunks += 1;
        Ok(())
    })
    .unwrap();
    let overflow = match outcome {
        Outcome::Written(sums) => {
            assert_eq!(sums, [None], "a result in memory has no sum");
            None
        }
        Outcome::Overflow(o) => Some(o),
    };
    (out, overflow)
}

#[test]
fn float16_widening_and_rounding_agree_on_every_value() {
    for h in 0..=u16::MAX {
        let x = f16_bits_to_f32(h);
        if x.is_nan() {
            assert!(f32_to_f16_bits(x) & 0x7c00 == 0x7c00 && f32_to_f16_bits(x) & 0x3ff != 0);
        } else {
            assert_eq!(f32_to_f16_bits(x), h, "{h:#06x}");
        }
    }
    // Ties to even, at a normal, a subnormal and the overflow threshold.
    assert_eq!(f32_to_f16_bits(1.0 + 2f32.powi(-11)), 0x3c00);
    assert_eq!(f32_to_f16_bits(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
    assert_eq!(f32_to_f16_bits(2f32.powi(-25)), 0);
    assert_eq!(f32_to_f16_bits(2f32.powi(-25) * 1.0001), 1);
    assert_eq!(f32_to_f16_bits(3.0 * 2f32.powi(-25)), 2);
    assert_eq!(f32_to_f16_bits(65519.0), 0x7bff);
    assert_eq!(f32_to_f16_bits(65520.0), 0x7c00);
    assert_eq!(f32_to_f16_bits(-1e9), 0xfc00);
}

#[test]
fn bfloat16_widening_and_rounding_agree_on_every_value() {
    for b in 0..=u16::MAX {
        let x = bf16_bits_to_f32(b);
        if !x.is_nan() {
            assert_eq!(f32_to_bf16_bits(x), b);
        }
    }
    assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even
    assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, odd
    assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7f80);
    assert_eq!(f32_to_bf16_bits(-f32::NAN), 0xffc0);
}

#[test]
fn average_of_many_sources_crosses_chunks_in_source_order() {
    let n = CHUNK * 2 + 7;
    let sources: Vec<Vec<u8>> = (0..5)
        .map(|s| {
            f32_bytes(
                &(0..n)
                    .map(|i| (i * 7 + s * 13) as f32 * 0.37)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    let weights = vec![0.5, 0.25, 0.75, 0.125, 0.625];
    let total: f64 = weights.iter().sum();
    let operation = Operation::Average {
        weights: weights.clone(),
        total,
    };
    let (out, overflow) = run_memory(&operation, DataType::Float, &sources);
    assert_eq!(overflow, None);
    for i in [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 6] {
        let x = |s: usize| {
            f64::from(f32::from_le_bytes(
                sources[s][i * 4..i * 4 + 4].try_into().unwrap(),
            ))
        };
        let mut acc = x(0) * weights[0];
        for (s, weight) in weights.iter().enumerate().skip(1) {
            acc += x(s) * weight;
        }
        let expected = (acc / total) as f32;
        assert_eq!(
            &out[i * 4..i * 4 + 4],
            &expected.to_le_bytes(),
            "element {i}"
        );
    }
}

/// Averages summed [`GROUP`] sources a pass give, element for element, the sum taken source by
/// source (`x_0*w_0`, then `+ x_i*w_i` in order, then `/ total`, rounded once): for 1 to 19
/// sources (groups and a remainder), lengths that end mid-lane, each float type, and values
/// where the order shows (large and small mixed, signed zeros: `-0*w` alone stays -0).
#[test]
fn grouped_averages_sum_every_element_in_source_order() {
    let n = CHUNK + 8 * 3 + 5;
    let value = |s: usize, i: usize| -> f64 {
        match (i * 31 + s * 17) % 7 {
            0 => -0.0,
            1 => 1e30 * if s.is_multiple_of(2) { 1.0 } else { -1.0 },
            2 => 1e-30,
            _ => ((i * 7919 + s * 104_729) % 10_007) as f64 * 0.001_37 - 6.0,
        }
    };
    for count in [1, 2, 3, 7, 8, 9, 16, 19] {
        let weights: Vec<f64> = (0..count).map(|s| 0.25 + s as f64 * 0.375).collect();
        let total: f64 = weights.iter().sum();
        let operation = Operation::Average {
            weights: weights.clone(),
            total,
        };
        for data_type in [
            DataType::Float,
            DataType::Double,
            DataType::Float16,
            DataType::Bfloat16,
        ] {
            let encode = |v: f64| -> Vec<u8> {
                match data_type {
                    DataType::Float => (v as f32).to_le_bytes().to_vec(),
                    DataType::Double => v.to_le_bytes().to_vec(),
                    DataType::Float16 => f32_to_f16_bits(v as f32).to_le_bytes().to_vec(),
                    _ => f32_to_bf16_bits(v as f32).to_le_bytes().to_vec(),
                }
            };
            let sources: Vec<Vec<u8>> = (0..count)
                .map(|s| (0..n).flat_map(|i| encode(value(s, i))).collect())
                .collect();
            let (out, overflow) = run_memory(&operation, data_type, &sources);
            assert_eq!(overflow, None);
            let size = sources[0].len() / n;
            let expected: Vec<u8> = (0..n)
                .flat_map(|i| {
                    let at = i * size..(i + 1) * size;
                    let x = |s: usize| -> Vec<u8> { sources[s][at.clone()].to_vec() };
                    match data_type {
                        DataType::Float | DataType::Double => {
                            let load = |b: Vec<u8>| match data_type {
                                DataType::Float => {
                                    f64::from(f32::from_le_bytes(b.try_into().unwrap()))
                                }
                                _ => f64::from_le_bytes(b.try_into().unwrap()),
                            };
                            let mut acc = load(x(0)) * weights[0];
                            for (s, w) in weights.iter().enumerate().skip(1) {
                                acc += load(x(s)) * w;
                            }
                            encode(acc / total)
                        }
                        _ => {
                            let load = |b: Vec<u8>| {
                                let bits = u16::from_le_bytes(b.try_into().unwrap());
                                match data_type {
                                    DataType::Float16 => f16_bits_to_f32(bits),
                                    _ => bf16_bits_to_f32(bits),
                                }
                            };
                            let mut acc = load(x(0)) * weights[0] as f32;
                            for (s, w) in weights.iter().enumerate().skip(1) {
                                acc += load(x(s)) * *w as f32;
                            }
                            let mean = acc / total as f32;
                            match data_type {
                                DataType::Float16 => f32_to_f16_bits(mean).to_le_bytes().to_vec(),
                                _ => f32_to_bf16_bits(mean).to_le_bytes().to_vec(),
                            }
                        }
                    }
                })
                .collect();
            if out != expected {
                let i = (0..n)
                    .find(|i| out[i * size..(i + 1) * size] != expected[i * size..(i + 1) * size])
                    .unwrap();
                panic!("{data_type:?}, {count} sources: element {i} differs");
            }
        }
    }
}

#[test]
fn a_result_that_does_not_fit_is_reported_at_its_first_element_but_non_finite_inputs_pass() {
    let a = f32_bytes(&[1.0, f32::INFINITY, 3e38, 3e38]);
    let b = f32_bytes(&[1.0, 1.0, 3e38, -3e38]);
    let (_, overflow) = run_memory(
        &Operation::Apply { scale: 1.0 },
        DataType::Float,
        &[a.clone(), b],
    );
    let overflow = overflow.unwrap();
    assert_eq!((overflow.job, overflow.element), (0, 2));
    assert_eq!(overflow.exact, 3e38f32 as f64 * 2.0);
    let b = f32_bytes(&[1.0, 1.0, -3e38, 3e38]);
    let (_, overflow) = run_memory(&Operation::Delta, DataType::Float, &[a, b]);
    assert_eq!(overflow.unwrap().element, 2);
    let b = f32_bytes(&[1.0, 1.0, f32::NAN, -3e38]);
    let a = f32_bytes(&[1.0, f32::INFINITY, 3e38, -3e38]);
    let (out, overflow) = run_memory(&Operation::Delta, DataType::Float, &[a, b]);
    assert_eq!(overflow, None); // inf - 1 and 3e38 - NaN: the user's, as the arithmetic makes them
    assert_eq!(&out[4..8], &f32::INFINITY.to_le_bytes());
    assert!(f32::from_le_bytes(out[8..12].try_into().unwrap()).is_nan());
}

#[test]
fn an_average_whose_sum_overflows_is_computed_from_the_shares() {
    let big = f64::MAX;
    let bytes = |v: f64| v.to_le_bytes().to_vec();
    let operation = Operation::Average {
        weights: vec![0.5, 0.5],
        total: 1.0,
    };
    let (out, overflow) = run_memory(&operation, DataType::Double, &[bytes(big), bytes(big)]);
    assert_eq!(overflow, None);
    assert_eq!(out, bytes(big));
}

#[test]
fn a_job_that_does_not_match_its_operation_is_refused() {
    let a = f32_bytes(&[1.0]);
    let mut out = vec![0u8; 4];
    let mut jobs = [Job {
        data_type: DataType::Float,
        inputs: vec![Input {
            bytes: &a,
            release: None,
        }],
        sink: Sink::Memory(&mut out),
    }];
    assert!(run(&Operation::Delta, &mut jobs, 1, &mut |_| Ok(())).is_err());
}

/// Results written to files come with the XXH3 sum of exactly the bytes written, in element
/// order, whatever order the threads finish their chunks in (many chunks, more threads than
/// cores, two tensors sharing a file at different offsets).
#[test]
fn results_in_files_carry_the_sums_of_the_bytes_written() {
    use std::os::unix::fs::FileExt;
    let n = 7 * CHUNK + 5;
    let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
    let b: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let (a, b) = (f32_bytes(&a), f32_bytes(&b));
    let dir = std::env::temp_dir().join(format!("ortckpt-compute-sums-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("out");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let second = (a.len() + 64) as u64;
    for threads in [1, 3, 8] {
        let input = |bytes| Input {
            bytes,
            release: None,
        };
        let mut memory = vec![0u8; a.len()];
        let mut jobs = [
            Job {
                data_type: DataType::Float,
                inputs: vec![input(&a), input(&b)],
                sink: Sink::File {
                    file: &file,
                    offset: 0,
                    path: &path,
                },
            },
            Job {
                data_type: DataType::Float,
                inputs: vec![input(&b), input(&a)],
                sink: Sink::Memory(&mut memory),
            },
            Job {
                data_type: DataType::Float,
                inputs: vec![input(&b), input(&a)],
                sink: Sink::File {
                    file: &file,
                    offset: second,
                    path: &path,
                },
            },
        ];
        let operation = Operation::Interpolate { a: 0.75, b: 0.25 };
        let outcome = run(&operation, &mut jobs, threads, &mut |_| Ok(())).unwrap();
        let mut written = vec![0u8; a.len()];
        file.read_exact_at(&mut written, 0).unwrap();
        let first = crate::seal::checksums::sum(&written);
        file.read_exact_at(&mut written, second).unwrap();
        assert_eq!(written, memory, "the same result in the file and in memory");
        let last = crate::seal::checksums::sum(&written);
        assert_eq!(
            outcome,
            Outcome::Written(vec![Some(first), None, Some(last)]),
            "{threads} threads"
        );
        assert_ne!(first, last);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An overflow ends the pass without a sum, and without a thread left waiting for a chunk
/// that never comes (the pass returns).
#[test]
fn an_overflow_ends_the_pass_with_no_sums_and_no_thread_waiting() {
    let n = 9 * CHUNK;
    let mut big = vec![1.0f32; n];
    big[3 * CHUNK + 7] = f32::MAX;
    let (a, big) = (f32_bytes(&vec![1.0f32; n]), f32_bytes(&big));
    let dir = std::env::temp_dir().join(format!("ortckpt-compute-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("out");
    let file = std::fs::File::create(&path).unwrap();
    for threads in [1, 2, 8] {
        let input = |bytes| Input {
            bytes,
            release: None,
        };
        let mut jobs: Vec<Job<'_>> = [&a, &big, &a]
            .iter()
            .enumerate()
            .map(|(i, x)| Job {
                data_type: DataType::Float,
                inputs: vec![input(x), input(x)],
                sink: Sink::File {
                    file: &file,
                    offset: (i * a.len()) as u64,
                    path: &path,
                },
            })
            .collect();
        let outcome = run(
            &Operation::Apply { scale: 1.0 },
            &mut jobs,
            threads,
            &mut |_| Ok(()),
        )
        .unwrap();
        let Outcome::Overflow(o) = outcome else {
            panic!("{threads} threads: {outcome:?}");
        };
        assert_eq!((o.job, o.element), (1, (3 * CHUNK + 7) as u64));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Chunk `c` of a test result: bytes that differ from chunk to chunk.
fn chunk_bytes(c: usize) -> Vec<u8> {
    (0..1000).map(|i| (i * 7 + c * 13) as u8).collect()
}

#[test]
fn chunks_summed_out_of_turn_give_the_sum_of_the_bytes_in_order() {
    let chunks = 6;
    let whole: Vec<u8> = (0..chunks).flat_map(chunk_bytes).collect();
    let sums = Sums::new(vec![Some(chunks), None]);
    // Every chunk but the first comes before its turn: kept, its thread handed another buffer.
    for c in (1..chunks).rev() {
        let mut bytes = chunk_bytes(c);
        sums.add(0, c, &mut bytes);
        assert_ne!(
            bytes,
            chunk_bytes(c),
            "a kept chunk's buffer stays with the sums"
        );
    }
    let mut first = chunk_bytes(0);
    sums.add(0, 0, &mut first);
    assert_eq!(
        first,
        chunk_bytes(0),
        "a chunk summed in turn keeps its buffer"
    );
    // A result in memory has no sum, whatever is added for it.
    sums.add(1, 0, &mut chunk_bytes(0));
    let state = sums.state.lock().unwrap();
    assert!(state.ahead.is_empty());
    assert_eq!(
        state.spare.len(),
        chunks - 1,
        "the kept chunks' buffers are spares again"
    );
    drop(state);
    assert_eq!(
        sums.finish(),
        [Some(crate::seal::checksums::sum(&whole)), None]
    );
}

#[test]
fn a_thread_far_ahead_waits_once_the_kept_chunks_are_at_their_bound() {
    let chunks = AHEAD + 3;
    let whole: Vec<u8> = (0..chunks).flat_map(chunk_bytes).collect();
    let sums = Sums::new(vec![Some(chunks)]);
    let finished = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        // This thread adds chunks 1.. : the first AHEAD are kept, the next one waits for
        // chunk 0, which comes from the other thread.
        scope.spawn(|| {
            for c in 1..chunks {
                sums.add(0, c, &mut chunk_bytes(c));
            }
            finished.store(1, Ordering::SeqCst);
        });
        while sums.state.lock().unwrap().ahead.len() < AHEAD {
            std::thread::yield_now();
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            finished.load(Ordering::SeqCst),
            0,
            "past the bound, a thread waits"
        );
        sums.add(0, 0, &mut chunk_bytes(0));
    });
    assert!(sums.state.lock().unwrap().ahead.len() <= AHEAD);
    assert_eq!(sums.finish(), [Some(crate::seal::checksums::sum(&whole))]);
}

/// Every finite float8 value rounds to itself, for each of the four types (the values as the
/// statistics kernel's tables give them); what lies beyond the largest value overflows.
#[test]
fn float8_rounding_keeps_every_value() {
    for (data_type, format) in [
        (DataType::Float8E4M3Fn, E4M3FN),
        (DataType::Float8E4M3Fnuz, E4M3FNUZ),
        (DataType::Float8E5M2, E5M2),
        (DataType::Float8E5M2Fnuz, E5M2FNUZ),
    ] {
        let table = super::stats::float8_table(data_type);
        for bits in 0..=255u8 {
            let value = table[usize::from(bits)];
            if value.is_finite() {
                assert_eq!(
                    f32_to_f8_bits(value as f32, format),
                    bits,
                    "{data_type:?} {bits:#04x}"
                );
            }
        }
        let largest = table[usize::from(format.largest)] as f32;
        assert_eq!(
            f32_to_f8_bits(largest * 2.0, format) & 0x7f,
            format.too_large & 0x7f
        );
    }
}
