"""The demo: models and adapters built here, since nothing can be downloaded.

assets.py    random-weight Llama-family models and PEFT adapters, byte-identical from a seed
training.py  the trained demo committed under assets/demo-trained (a copying base model and
             one adapter per visible task), and how to train it again
showcase.py  what `lorafleet up` prints once it serves: one request per model, side by side,
             and the letters adapter's tool round trip
words.py     the trained demo's word-level vocabulary (the tool-call words included)
letters.py   the letters task: count_letters, its tool, its template and examples
"""
