use proptest::prelude::*;
use std::sync::Arc;
use strata::data::{
    tokenize_files, BatchOffsets, Batching, DataLoader, LoaderConfig, Order, TokenData, TokenWidth, TokenizeOptions,
    Tokenizer,
};

/// Best-fit decreasing packing makes TRL's rows (`pack_dataset(strategy="bfd")`, live): the
/// same examples in each row, in the same order, over runs of a thousand examples, with
/// empty examples left out and longer ones cut to the row.
#[test]
fn best_fit_rows_are_those_trl_packs() {
    let Some(py) = crate::hf_reference::python() else { return };
    let mut state = 11u64;
    let mut next = |n: u64| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    // Mostly short, some long, a few empty or past the row: every kind of fit and tie.
    let lengths: Vec<usize> = (0..2300)
        .map(|_| match next(10) {
            0 => next(3) as usize * 40,
            1..=3 => 20 + next(45) as usize,
            _ => 1 + next(12) as usize,
        })
        .collect();
    let answer = crate::hf_reference::reference(
        &py,
        &["trl-pack", "--lengths", &serde_json::to_string(&lengths).unwrap(), "--seq-length", "64"],
    );
    let theirs: Vec<Vec<usize>> = serde_json::from_str(&answer).unwrap();
    let ours = strata::data::best_fit_rows(&lengths, 64);
    assert!(ours.len() > 300, "{} rows", ours.len());
    assert_eq!(ours, theirs);
}

/// A small word-level tokenizer.json, written as the Hugging Face format describes it.
fn word_level_tokenizer(dir: &std::path::Path) -> std::path::PathBuf {
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4}, "unk_token": "[UNK]"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

#[test]
fn hugging_face_tokenizers_load_and_encode() {
    let dir = tempfile::tempdir().unwrap();
    let t = Tokenizer::from_file(&word_level_tokenizer(dir.path())).unwrap();
    assert_eq!(t.vocab_size(), 5);
    assert_eq!(t.encode("to be or not to be maybe").unwrap(), vec![1, 2, 3, 4, 1, 2, 0]);
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "to be or not to be").unwrap();
    let data = TokenData::from_text_file(&text, &t).unwrap();
    assert_eq!(data.to_vec(), vec![1, 2, 3, 4, 1, 2]);
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    assert!(Tokenizer::from_file(&bad).err().unwrap().to_string().contains("bad.json"));
}

#[test]
fn byte_tokenizer_round_trips_text() {
    let t = Tokenizer::Bytes;
    let ids = t.encode("héllo").unwrap();
    assert_eq!(ids.len(), 6, "bytes, not characters");
    assert_eq!(t.decode(&ids).unwrap(), "héllo");
    let err = t.decode(&[104, 300]).unwrap_err().to_string();
    assert!(err.contains("token 300 is no byte"), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn u16_token_files_round_trip(tokens in proptest::collection::vec(0u32..65536, 0..300)) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        TokenData::new(tokens.clone(), "p").write_u16_file(&path).unwrap();
        let read = TokenData::open(&path, None).unwrap();
        prop_assert_eq!(read.width(), Some(TokenWidth::U16));
        prop_assert_eq!(read.to_vec(), tokens);
    }

    /// Files with a header say their width; raw u32 files read at the width asked for.
    #[test]
    fn u32_token_files_round_trip_with_and_without_a_header(tokens in proptest::collection::vec(0u32..=u32::MAX, 0..300)) {
        let dir = tempfile::tempdir().unwrap();
        let (headed, raw) = (dir.path().join("h.bin"), dir.path().join("r.bin"));
        let data = TokenData::new(tokens.clone(), "p");
        data.write_token_file(&headed, TokenWidth::U32).unwrap();
        let read = TokenData::open(&headed, None).unwrap();
        prop_assert_eq!(read.width(), Some(TokenWidth::U32));
        prop_assert_eq!(read.to_vec(), tokens.clone());
        std::fs::write(&raw, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        prop_assert_eq!(TokenData::open(&raw, Some(TokenWidth::U32)).unwrap().to_vec(), tokens);
    }

    /// Any bytes open as a token file or fail with a message naming the file.
    #[test]
    fn token_files_of_any_bytes_open_or_fail_cleanly(
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
        headed in any::<bool>(),
        width in proptest::option::of(prop_oneof![Just(TokenWidth::U16), Just(TokenWidth::U32)]),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("any.bin");
        let mut content = if headed { b"STRATOKS".to_vec() } else { vec![] };
        content.extend(bytes);
        std::fs::write(&path, &content).unwrap();
        match TokenData::open(&path, width) {
            Ok(data) => {
                let w = data.width().unwrap_or(TokenWidth::U16).bytes();
                prop_assert!(data.len() * w <= content.len());
                let _ = data.vocab_needed();
            }
            Err(e) => prop_assert!(e.to_string().contains("any.bin"), "{}", e),
        }
    }

    #[test]
    fn batch_offset_files_parse_or_fail_cleanly(text in ".{0,200}") {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.json");
        std::fs::write(&path, &text).unwrap();
        if let Err(e) = BatchOffsets::from_file(&path) {
            prop_assert!(e.to_string().contains("o.json"));
        }
    }

    #[test]
    fn batch_offsets_replay_exact_windows(
        rows in proptest::collection::vec(proptest::collection::vec(0usize..90, 3), 1..5),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("o.json");
        std::fs::write(&path, serde_json::json!({"ctx": 8, "batch": 3, "offsets": rows}).to_string()).unwrap();
        let plan = BatchOffsets::from_file(&path).unwrap();
        let data = TokenData::new((0..100).map(|i| i * 7 % 251).collect(), "p");
        let steps: Vec<_> =
            DataLoader::new(Arc::new(data.clone().into()), LoaderConfig::new(Batching { order: Order::Offsets(plan), ..Batching::new(8, 3) })).unwrap().collect();
        prop_assert_eq!(steps.len(), rows.len());
        for (step, offsets) in steps.iter().zip(&rows) {
            let b = &step.as_ref().unwrap().micro_batches[0];
            let inputs = Vec::<Vec<i64>>::try_from(&b.inputs).unwrap();
            let targets = Vec::<Vec<i64>>::try_from(&b.targets).unwrap();
            for (r, &o) in offsets.iter().enumerate() {
                let want: Vec<i64> = (o..o + 8).map(|i| i64::from(data.get(i))).collect();
                let next: Vec<i64> = (o + 1..o + 9).map(|i| i64::from(data.get(i))).collect();
                prop_assert_eq!(&inputs[r], &want);
                prop_assert_eq!(&targets[r], &next);
            }
        }
    }
}

/// A bad token file is one clear message each: a size that is no whole number of ids, a
/// header that contradicts the width asked for, a header cut short, a u16 file for a
/// vocabulary past 65,536, an id past the vocabulary.
#[test]
fn bad_token_files_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, bytes: &[u8]| {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let error = |path: &std::path::Path, width| TokenData::open(path, width).unwrap_err().to_string();
    let odd = file("odd.bin", &[1, 0, 2]);
    assert!(error(&odd, None).contains("3 bytes is not a whole number of u16 tokens"), "{}", error(&odd, None));
    let six = file("six.bin", &[1, 0, 2, 0, 3, 0]);
    assert!(error(&six, Some(TokenWidth::U32)).contains("6 bytes is not a whole number of u32 tokens"));
    let headed = dir.path().join("headed.bin");
    TokenData::new(vec![70_000, 5], "t").write_token_file(&headed, TokenWidth::U32).unwrap();
    assert!(
        error(&headed, Some(TokenWidth::U16)).contains("holds u32 ids (its header says so) but u16 ids were asked for")
    );
    let cut = file("cut.bin", b"STRATOKS\x04\0");
    assert!(error(&cut, None).contains("ends inside its header"));
    let narrow = TokenData::open(&six, None).unwrap();
    let err = narrow.check_fits(2, 128_256).unwrap_err().to_string();
    assert!(err.contains("six.bin holds u16 ids, too narrow for the model's vocabulary of 128256"), "{err}");
    let wide = TokenData::open(&headed, None).unwrap();
    assert!(wide.check_fits(1, 128_256).is_ok());
    let err = wide.check_fits(1, 65_536).unwrap_err().to_string();
    assert!(err.contains("holds token id 70000 but the model's vocabulary is 65536"), "{err}");
    assert!(TokenData::new(vec![70_000], "t").write_u16_file(&dir.path().join("x.bin")).is_err());
}

/// Tokenizing files in pieces, in parallel batches, gives the ids of encoding each whole
/// file, in order, behind a header of the width asked for; a file that is not UTF-8 fails
/// with its byte offset and leaves no output.
#[test]
fn tokenize_files_equal_encoding_each_file_whole() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = Tokenizer::from_file(&word_level_tokenizer(dir.path())).unwrap();
    let words = ["to", "be", "or", "not", "maybe"];
    let mut x = 3u64;
    let mut text = |lines: usize| {
        (0..lines)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                let n = (x >> 60) as usize + 1;
                (0..n).map(|k| words[((x >> (8 * (k % 7))) % 5) as usize]).collect::<Vec<_>>().join(" ") + "\n"
            })
            .collect::<String>()
    };
    let (a, b) = (dir.path().join("a.txt"), dir.path().join("b.txt"));
    std::fs::write(&a, text(500)).unwrap();
    std::fs::write(&b, text(37)).unwrap();
    let out = dir.path().join("out.tok");
    let options = TokenizeOptions { width: Some(TokenWidth::U32), piece_bytes: 100, batch_pieces: 3 };
    let mut calls = 0;
    let report = tokenize_files(&[a.clone(), b.clone()], &tokenizer, &out, &options, &mut |done, total| {
        calls += 1;
        assert!(done <= total);
    })
    .unwrap();
    let mut whole = TokenData::from_text_file(&a, &tokenizer).unwrap().to_vec();
    whole.extend(TokenData::from_text_file(&b, &tokenizer).unwrap().to_vec());
    let written = TokenData::open(&out, None).unwrap();
    assert_eq!(written.width(), Some(TokenWidth::U32));
    assert_eq!(written.to_vec(), whole);
    assert_eq!(report.tokens as usize, whole.len());
    assert!(calls > 10, "progress is reported batch by batch ({calls} calls)");
    // The byte tokenizer's vocabulary fits u16, its default.
    let bytes_out = dir.path().join("bytes.tok");
    tokenize_files(
        std::slice::from_ref(&b),
        &Tokenizer::Bytes,
        &bytes_out,
        &TokenizeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let read = TokenData::open(&bytes_out, None).unwrap();
    assert_eq!(
        (read.width(), read.to_vec()),
        (Some(TokenWidth::U16), std::fs::read(&b).unwrap().into_iter().map(u32::from).collect())
    );
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, b"to be\nor \xff not").unwrap();
    let failed = dir.path().join("failed.tok");
    let err = tokenize_files(&[bad], &tokenizer, &failed, &options, &mut |_, _| {}).unwrap_err().to_string();
    assert!(err.contains("bad.txt: not UTF-8 text at byte 9"), "{err}");
    assert!(!failed.exists());
    assert_eq!(
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.'))
            .count(),
        0,
        "no staging file is left"
    );
}
