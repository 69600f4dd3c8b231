use proptest::prelude::*;
use std::sync::Arc;
use strata::data::{BatchOffsets, DataLoader, LoaderConfig, Order, TokenData, Tokenizer};

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
    assert_eq!(data.tokens, vec![1, 2, 3, 4, 1, 2]);
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
        prop_assert_eq!(TokenData::from_u16_file(&path).unwrap().tokens, tokens);
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
        let data = Arc::new(TokenData::new((0..100).map(|i| i * 7 % 251).collect(), "p"));
        let steps: Vec<_> = DataLoader::new(data.clone(), LoaderConfig::new(8, 3), Order::Offsets(plan)).unwrap().collect();
        prop_assert_eq!(steps.len(), rows.len());
        for (step, offsets) in steps.iter().zip(&rows) {
            let b = &step.as_ref().unwrap().micro_batches[0];
            let inputs = Vec::<Vec<i64>>::try_from(&b.inputs).unwrap();
            let targets = Vec::<Vec<i64>>::try_from(&b.targets).unwrap();
            for (r, &o) in offsets.iter().enumerate() {
                let want: Vec<i64> = data.tokens[o..o + 8].iter().map(|&t| t as i64).collect();
                let next: Vec<i64> = data.tokens[o + 1..o + 9].iter().map(|&t| t as i64).collect();
                prop_assert_eq!(&inputs[r], &want);
                prop_assert_eq!(&targets[r], &next);
            }
        }
    }
}
