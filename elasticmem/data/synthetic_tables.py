"""The tables of the synthetic memory task (``elasticmem.data.synthetic``): persona fact categories with
their value pools and sentence templates, other people and relations, session fillers, the assistant's
replies, and the tiny variant's words.

``elasticmem.config`` checks ``SyntheticConfig`` against these tables' sizes, written there as numbers
(the config is the ground floor and imports no feature module); ``_check_limits`` refuses to run when
the two disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Category:
    """One kind of persona fact: its value pool and the sentences that carry it.

    ``{s}`` is the subject ("I", "My neighbor", "Maya" in statements; "I",
    "my sister" in questions) and ``{v}`` the value. Statements are past tense
    so one template fits every subject.
    """

    name: str
    statement: str
    question: str
    update: str
    """First-person statement that replaces an earlier value (knowledge_update)."""
    question_now: str
    values: tuple[str, ...]


PERSONA_CATEGORIES: tuple[Category, ...] = (
    Category(
        "dog", "{s} adopted a dog named {v}.", "What is the name of the dog {s} adopted?",
        "My old dog went to live with my parents, and I adopted a new dog named {v}.",
        "What is the name of my dog now?",
        ("Biscuit", "Waffles", "Noodle", "Pickles", "Mochi", "Bubbles", "Ziggy", "Snickers",
         "Pretzel", "Muffin", "Sprinkles", "Nugget", "Peanut", "Bandit", "Rocket", "Gizmo",
         "Scooter", "Pebbles", "Sparky", "Fudge", "Marshmallow", "Doodle", "Wiggles", "Jellybean",
         "Cupcake", "Buttons", "Chewie", "Domino", "Pixel", "Nacho", "Zorro", "Pumpkin", "Truffle",
         "Clover"),
    ),
    Category(
        "city", "{s} moved to {v}.", "Which city did {s} move to?",
        "I moved again, I live in {v} now.", "Which city do I live in now?",
        ("Porto", "Oslo", "Denver", "Seattle", "Lisbon", "Vienna", "Prague", "Dublin", "Austin",
         "Boston", "Chicago", "Toronto", "Madrid", "Berlin", "Munich", "Zurich", "Geneva",
         "Helsinki", "Stockholm", "Copenhagen", "Amsterdam", "Brussels", "Krakow", "Budapest",
         "Athens", "Milan", "Naples", "Seville", "Valencia", "Lyon", "Marseille", "Edinburgh",
         "Glasgow", "Montreal", "Vancouver", "Portland", "Atlanta", "Nashville", "Kyoto", "Osaka",
         "Melbourne", "Auckland"),
    ),
    Category(
        "field", "{s} started working in {v}.", "Which field did {s} start working in?",
        "I changed careers and now I work in {v}.", "Which field do I work in now?",
        ("accounting", "nursing", "marketing", "architecture", "journalism", "dentistry",
         "carpentry", "plumbing", "logistics", "insurance", "robotics", "pharmacy", "forestry",
         "publishing", "banking", "teaching", "translation", "cybersecurity", "animation",
         "aviation", "hospitality", "landscaping", "tailoring", "welding", "radiology",
         "physiotherapy", "consulting", "recruiting", "genetics", "oceanography", "archaeology",
         "economics"),
    ),
    Category(
        "dish", "{s} learned to cook {v}.", "Which dish did {s} learn to cook?",
        "Lately the dish I cook every week is {v}.", "Which dish do I cook every week now?",
        ("lasagna", "ramen", "paella", "risotto", "goulash", "moussaka", "gnocchi", "dumplings",
         "falafel", "shakshuka", "enchiladas", "burritos", "pho", "biryani", "ratatouille",
         "quiche", "gazpacho", "ceviche", "pierogi", "borscht", "tagine", "couscous", "gumbo",
         "jambalaya", "carbonara", "bibimbap", "bulgogi", "tempura", "katsu", "satay", "laksa",
         "empanadas", "tamales", "fondue", "souvlaki"),
    ),
    Category(
        "instrument", "{s} started taking lessons on the {v}.",
        "Which instrument did {s} start taking lessons on?",
        "I switched instruments and now I practice the {v} every day.",
        "Which instrument do I practice now?",
        ("piano", "violin", "cello", "guitar", "banjo", "ukulele", "harp", "flute", "clarinet",
         "saxophone", "trumpet", "trombone", "drums", "accordion", "harmonica", "mandolin", "oboe",
         "bassoon", "tuba", "xylophone", "bagpipes", "sitar", "marimba", "piccolo", "viola", "lute",
         "harpsichord", "didgeridoo", "bongos", "synthesizer", "kalimba", "glockenspiel"),
    ),
    Category(
        "car", "{s} bought a new car made by {v}.", "Which car brand did {s} buy?",
        "I sold my old car and bought one made by {v}.", "Which car brand do I drive now?",
        ("Toyota", "Honda", "Ford", "Subaru", "Mazda", "Volvo", "Audi", "Tesla", "Kia", "Hyundai",
         "Nissan", "Peugeot", "Renault", "Fiat", "Skoda", "Opel", "Chevrolet", "Jeep", "Dodge",
         "Lexus", "Porsche", "Jaguar", "Mini", "Saab", "Citroen", "Suzuki", "Mitsubishi", "Buick",
         "Cadillac", "Acura", "Infiniti", "Lancia", "Dacia"),
    ),
    Category(
        "hobby", "{s} recently took up {v}.", "Which hobby did {s} take up?",
        "I dropped my old hobby and now I spend my free time on {v}.",
        "Which hobby do I spend my free time on now?",
        ("pottery", "knitting", "birdwatching", "calligraphy", "origami", "woodworking",
         "beekeeping", "juggling", "geocaching", "bouldering", "stargazing", "scrapbooking",
         "embroidery", "quilting", "crochet", "glassblowing", "leathercraft", "bonsai", "sketching",
         "falconry", "kayaking", "canoeing", "orienteering", "taxidermy", "skydiving",
         "paragliding", "snorkeling", "archery", "ventriloquism", "whittling", "macrame"),
    ),
    Category(
        "language", "{s} started learning {v}.", "Which language did {s} start learning?",
        "I switched languages and now I study {v}.", "Which language am I studying now?",
        ("Spanish", "French", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Norwegian",
         "Danish", "Finnish", "Polish", "Czech", "Greek", "Turkish", "Arabic", "Hebrew", "Hindi",
         "Bengali", "Japanese", "Korean", "Mandarin", "Cantonese", "Vietnamese", "Indonesian",
         "Swahili", "Russian", "Ukrainian", "Hungarian", "Romanian", "Icelandic", "Welsh",
         "Tagalog", "Persian"),
    ),
    Category(
        "drink", "{s} got hooked on {v}.", "Which drink did {s} get hooked on?",
        "I gave up my old favorite drink and now I have {v} every day.",
        "Which drink do I have every day now?",
        ("espresso", "matcha", "kombucha", "chai", "cappuccino", "macchiato", "cortado",
         "americano", "lemonade", "cider", "oolong", "rooibos", "horchata", "kefir", "lassi",
         "sangria", "mojito", "eggnog", "limeade", "frappe", "root beer", "ginger ale",
         "hot chocolate", "cold brew", "yerba mate", "chamomile", "ayran", "kvass", "mead",
         "tepache", "boza"),
    ),
    Category(
        "color", "{s} painted the living room {v}.", "Which color did {s} paint the living room?",
        "I repainted the living room, it is {v} now.", "What color is my living room now?",
        ("teal", "maroon", "lavender", "beige", "turquoise", "crimson", "magenta", "ochre", "navy",
         "coral", "ivory", "charcoal", "burgundy", "lilac", "indigo", "violet", "amber", "emerald",
         "scarlet", "cobalt", "khaki", "taupe", "mauve", "periwinkle", "chartreuse", "fuchsia",
         "aquamarine", "cerulean", "vermilion", "sepia"),
    ),
    Category(
        "country", "{s} went on a trip to {v}.", "Which country did {s} travel to?",
        "My most recent trip was to {v}.", "Which country did I visit most recently?",
        ("Portugal", "Norway", "Iceland", "Peru", "Chile", "Argentina", "Brazil", "Mexico",
         "Canada", "Japan", "Vietnam", "Thailand", "Morocco", "Egypt", "Kenya", "Tanzania", "Ghana",
         "Croatia", "Slovenia", "Estonia", "Latvia", "Lithuania", "Armenia", "Nepal", "Bhutan",
         "Mongolia", "Cambodia", "Oman", "Malta", "Cyprus", "Ireland", "Austria", "Belgium",
         "Colombia", "Ecuador", "Bolivia", "Uruguay"),
    ),
    Category(
        "sport", "{s} joined a local {v} team.", "Which sport did {s} join a team for?",
        "I switched sports and now I play {v} every weekend.", "Which sport do I play now?",
        ("rugby", "cricket", "volleyball", "badminton", "handball", "lacrosse", "hockey",
         "baseball", "softball", "basketball", "netball", "squash", "tennis", "curling", "golf",
         "bowling", "darts", "polo", "football", "futsal", "korfball", "dodgeball", "kickball",
         "pickleball", "padel", "croquet", "billiards", "snooker", "bocce", "hurling", "frisbee",
         "racquetball"),
    ),
)

RELATIONS: tuple[str, ...] = (
    "sister", "brother", "cousin", "neighbor", "coworker", "boss", "roommate", "best friend",
    "aunt", "uncle", "mentor", "classmate", "nephew", "niece", "landlord", "teammate",
    "grandmother", "grandfather", "godmother", "godfather", "tutor", "barber", "doctor",
    "therapist",
)
"""Other people a fact can be about; distractors and multi-hop links use them."""

PERSON_NAMES: tuple[str, ...] = (
    "Maya", "Leo", "Nora", "Ethan", "Iris", "Omar", "Priya", "Lucas", "Zoe", "Hugo", "Ava",
    "Felix", "Lena", "Mateo", "Clara", "Jonas", "Elena", "Ravi", "Sofia", "Theo", "Mila", "Ivan",
    "Alma", "Nico", "Yara", "Oscar", "Freya", "Arjun", "Ines", "Kai", "Lucia", "Tomas", "Anya",
    "Emil", "Rosa", "Dario", "Selma", "Marco", "Greta", "Samir",
)
"""Names that multi-hop links introduce ("My sister is called Maya.")."""

LINK_TEMPLATE = "My {r} is called {n}."

FILLER: tuple[str, ...] = (
    "The weather has been strange this week.",
    "I finally cleaned out my garage over the weekend.",
    "Work was really busy today.",
    "I watched a documentary about whales last night.",
    "My internet connection keeps dropping.",
    "I slept in late this morning.",
    "The traffic downtown was terrible today.",
    "I am trying to drink more water.",
    "I found an old photo album in the attic.",
    "My phone battery died in the middle of a call.",
    "I have been thinking about rearranging my furniture.",
    "It rained all afternoon.",
    "I started a new jigsaw puzzle with a thousand pieces.",
    "I forgot my umbrella again.",
    "The grocery store was out of bread.",
    "I have an appointment next week that I keep forgetting about.",
    "I need to fix the fence in the backyard.",
    "There was a loud party down the street last night.",
    "I need to renew my passport soon.",
    "I spent the evening answering emails.",
    "I tried a new route for my morning walk.",
    "The power went out for an hour today.",
    "I am reading a long mystery novel.",
    "I cannot decide what to watch tonight.",
)
"""Small talk with no fact in it (num_filler of these per persona history)."""

ACKNOWLEDGEMENTS: tuple[str, ...] = (
    "Thanks for sharing that with me.",
    "Got it, I will keep that in mind.",
    "That sounds lovely.",
    "Noted, thanks for letting me know.",
    "Good to know!",
    "Interesting, tell me more any time.",
    "I appreciate you telling me.",
)
"""Assistant replies of ``assistant_replies="acknowledge"``; they never repeat a value,
so each value lives in exactly one chunk."""

REPLY_NOUNS: dict[str, str] = {
    "dog": "dog", "city": "city", "field": "field", "dish": "dish", "instrument": "instrument",
    "car": "car brand", "hobby": "hobby", "language": "language", "drink": "drink", "color": "color",
    "country": "country", "sport": "sport",
}
"""The attribute a category's question asks for, as engaged replies name it."""

FACT_OPENERS: dict[str, tuple[str, ...]] = {
    "dog": ("{V}, what a cute name!", "A dog named {v}, how sweet!", "{V} sounds adorable."),
    "city": ("{V}, how exciting!", "A move to {v}, wow!", "{V} is a lovely place."),
    "field": ("{V}, what a change!", "A job in {v}, nice!", "{V} sounds rewarding."),
    "dish": ("{V}, yum!", "Homemade {v}, nice!", "{V} sounds tasty."),
    "instrument": ("The {v}, how lovely!", "Lessons on the {v}, nice!", "The {v} sounds fun."),
    "car": ("{V}, nice!", "A new {v}, great!", "{V} makes good cars."),
    "hobby": ("{V}, how fun!", "{V} sounds relaxing.", "Taking up {v}, nice!"),
    "language": ("{V}, great choice!", "Learning {v}, nice!", "{V} sounds beautiful."),
    "drink": ("{V}, yum!", "{V} every day, nice!", "{V} sounds delicious."),
    "color": ("{V}, how bold!", "{V} walls, nice!", "{V} sounds cozy."),
    "country": ("{V}, how exciting!", "A trip to {v}, wow!", "{V} must have been amazing."),
    "sport": ("{V}, how fun!", "A {v} team, nice!", "{V} is a great sport."),
}
"""First sentence of an engaged reply to a fact, per category: it names the value
(``{v}``, or ``{V}`` capitalised)."""

REPLY_CLOSERS: tuple[str, ...] = (
    "What is the next {noun}? Tell me more.",
    "Which {noun} is next? Tell me more.",
    "What will the next {noun} be? Tell me more.",
    "What is special about this {noun}? Tell me more.",
    "What is the story behind this {noun}? Tell me more.",
)
"""Second sentence of an engaged reply to a fact: a follow-up that names the attribute
(``{noun}``, from ``REPLY_NOUNS``) near the chunk's end, where its bank key is read.
The wording was chosen by measuring recall of evidence with SmolLM2-135M's frozen
state (issue 12): a closing question about the attribute followed by "Tell me more."
ranked the evidence chunk highest among the phrasings tried."""

LINK_REPLIES: tuple[str, ...] = (
    "Nice to hear about {n}. Are you close with your {r}?",
    "{n} is a lovely name. How often do you see your {r}?",
    "Thanks for telling me about {n}. What is your {r} like?",
    "So your {r} is {n}. Do you two get along?",
    "Good to know {n} is your {r}. Does {n} live nearby?",
)
"""Engaged replies to a multi-hop link ("My sister is called Maya."): ``{r}`` relation, ``{n}`` name."""

FILLER_REPLIES: dict[str, tuple[str, ...]] = {
    "The weather has been strange this week.": (
        "Strange how? Has it been too warm for the season?", "I hope it settles down soon. Rain or sun?"),
    "I finally cleaned out my garage over the weekend.": (
        "That must feel great! Did you find anything surprising in the garage?",
        "Well done, that is a big job. What did you do with the old stuff?"),
    "Work was really busy today.": (
        "Sorry to hear that. Did you get a break at all?", "Busy days are tiring. What kept you so busy?"),
    "I watched a documentary about whales last night.": (
        "Whales are fascinating! What was the most surprising part?",
        "That sounds interesting. Which whales did the documentary cover?"),
    "My internet connection keeps dropping.": (
        "That is so annoying. Have you tried restarting the router?",
        "Ugh, a flaky connection is the worst. Did you call your provider?"),
    "I slept in late this morning.": (
        "Sounds like you needed the rest! Do you feel refreshed?", "Nice, a lazy morning. Was it a day off?"),
    "The traffic downtown was terrible today.": (
        "Oh no, how long were you stuck in traffic?", "Traffic like that is exhausting. Was there an accident?"),
    "I am trying to drink more water.": (
        "Good plan! Do you use a bottle with markings to keep track?",
        "That is a healthy habit. How many glasses a day are you aiming for?"),
    "I found an old photo album in the attic.": (
        "How fun! Were there any old family photos in it?", "What a find. Whose photos were in the album?"),
    "My phone battery died in the middle of a call.": (
        "That is frustrating. Is the phone getting old?", "Oh no! Were you able to call them back?"),
    "I have been thinking about rearranging my furniture.": (
        "A new layout can refresh a room. Which room would you start with?",
        "Sounds like a fun project. Do you have a plan for the furniture yet?"),
    "It rained all afternoon.": (
        "A rainy afternoon is perfect for staying in. What did you do inside?",
        "Did you get caught in the rain?"),
    "I started a new jigsaw puzzle with a thousand pieces.": (
        "A thousand pieces is ambitious! What is the picture on the puzzle?",
        "Nice! Do you start with the edges of the puzzle?"),
    "I forgot my umbrella again.": (
        "Oh no, did you get soaked?", "That happens to everyone. Maybe keep a spare umbrella at work?"),
    "The grocery store was out of bread.": (
        "That is annoying. Did you find bread somewhere else?",
        "Maybe it is a sign to try baking bread at home?"),
    "I have an appointment next week that I keep forgetting about.": (
        "Want to set a reminder for the appointment?", "It helps to write it down. What day is the appointment?"),
    "I need to fix the fence in the backyard.": (
        "Is the fence badly damaged?", "Fixing a fence is a good weekend job. Will you do it yourself?"),
    "There was a loud party down the street last night.": (
        "Did the noise keep you up?", "That sounds annoying. How late did the party go on?"),
    "I need to renew my passport soon.": (
        "Good idea to do it early. Are you planning to travel soon?",
        "Renewals can take a while. When does your passport expire?"),
    "I spent the evening answering emails.": (
        "That sounds tedious. Did you clear your inbox?", "Not the most fun evening. Were the emails for work?"),
    "I tried a new route for my morning walk.": (
        "Nice change! What did you see on the new route?", "How long was the new walk?"),
    "The power went out for an hour today.": (
        "That is inconvenient. Do you know what caused the outage?",
        "Did the power cut spoil anything in the fridge?"),
    "I am reading a long mystery novel.": (
        "I love a good mystery! Who do you think the culprit is?",
        "How far into the novel are you?"),
    "I cannot decide what to watch tonight.": (
        "Are you in the mood for a comedy or a thriller?", "How about a classic film you have seen before?"),
}
"""Engaged replies to each small-talk line of ``FILLER``."""

GREETINGS: tuple[tuple[str, str], ...] = (
    ("Hi, it's me again.", "Welcome back! What is on your mind?"),
    ("Hello! Do you have a minute to chat?", "Of course, I am happy to chat."),
    ("Hey, I'm back.", "Hi! How can I help today?"),
    ("Good morning!", "Good morning! What would you like to talk about?"),
)
"""Session openers; they also keep every session non-empty whatever the sampling."""

TINY_KEYS: tuple[str, ...] = (
    "cat", "dog", "sun", "box", "cup", "hat", "key", "map", "pen", "bed", "car", "egg",
    "fox", "jar", "owl", "pig", "bus", "cow", "bee", "ant", "bat", "rug", "toy", "van",
)
"""Key nouns of the tiny variant; the first num_keys of them are in use."""

OPTION_LETTERS: tuple[str, ...] = tuple("abcdefghij")
TINY_QUESTION_WORD = "recall"
TINY_FIXED_WORDS: tuple[str, ...] = ("User", TINY_QUESTION_WORD)
"""Words the tiny variant emits besides keys and letters ("User" is the chunk's role label)."""

VOCABULARY: tuple[str, ...] = TINY_FIXED_WORDS + OPTION_LETTERS + TINY_KEYS
"""Every word the tiny variant can emit (chunks, questions, choices), in a fixed order."""
TINY_WORDS = VOCABULARY


def _check_limits() -> None:
    """elasticmem.config checks SyntheticConfig against these tables' sizes, written there as
    numbers: refuse to run with tables that no longer match them."""
    from elasticmem import config as C

    sizes = {"SYNTHETIC_TINY_KEYS": len(TINY_KEYS), "SYNTHETIC_CATEGORIES": len(PERSONA_CATEGORIES),
             "SYNTHETIC_VALUE_POOL": min(len(c.values) for c in PERSONA_CATEGORIES),
             "SYNTHETIC_RELATIONS": len(RELATIONS), "SYNTHETIC_PERSON_NAMES": len(PERSON_NAMES),
             "SYNTHETIC_FILLER": len(FILLER)}
    wrong = {k: (getattr(C, k), v) for k, v in sizes.items() if getattr(C, k) != v}
    if wrong:
        raise ImportError(f"elasticmem.config's synthetic limits disagree with the tables of {__name__} "
                          f"(config, tables): {wrong}")


_check_limits()
