"""Wordle secret words: common 5-letter nouns (all in web2 and textarena's dictionaries).

Read by build_data.py at image build time (becomes NLTK's words/en-basic) and by task.py.
"""

SECRET_WORDS = (
    "apple", "beach", "bench", "berry", "blade", "board", "bread", "brick", "brush", "cabin",
    "camel", "candy", "chair", "chalk", "cheek", "chest", "child", "cloud", "coast", "couch",
    "crown", "dream", "drink", "eagle", "earth", "fence", "field", "flame", "flute", "frost",
    "fruit", "ghost", "glass", "grape", "grass", "heart", "honey", "horse", "hotel", "house",
    "jewel", "juice", "knife", "lemon", "light", "lunch", "maple", "metal", "money", "mouse",
    "music", "night", "ocean", "onion", "paint", "paper", "peach", "pearl", "piano", "pilot",
    "plant", "plate", "queen", "radio", "river", "robin", "salad", "sheep", "shelf", "shirt",
    "skirt", "smoke", "snake", "spoon", "stone", "storm", "sugar", "table", "tiger", "toast",
    "tooth", "tower", "train", "truck", "water", "whale", "wheel", "world",
)
