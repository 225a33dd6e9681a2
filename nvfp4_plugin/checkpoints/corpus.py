"""A small built-in text set: trains make-model's tokenizer and calibrates activation scales offline.

Written for this project (plain prose, dialogue, instructions, numbers and a little code, so that
byte-level BPE learns common English pieces and calibration sees varied token statistics).
"""

from __future__ import annotations

PARAGRAPHS = (
    """The harbour was quiet before sunrise. A few gulls circled above the fishing boats, and the
smell of salt and diesel hung over the water. Marta unlocked the ticket office, switched on the
kettle and wrote the day's ferry times on the chalkboard: seven fifteen, nine thirty, noon, and
the last crossing at half past five.""",
    """To bake a simple loaf, mix five hundred grams of flour with ten grams of salt, seven grams of
yeast and about three hundred and fifty millilitres of warm water. Knead the dough for ten
minutes, let it rise for an hour, shape it, and bake it at two hundred and twenty degrees for
thirty five minutes.""",
    """User: Can you explain what a prime number is?
Assistant: A prime number is a whole number greater than one whose only divisors are one and
itself. Two, three, five, seven and eleven are prime; nine is not, because it equals three times
three.""",
    """The committee met on Thursday to review the budget. Spending on roads rose by four percent,
while the library fund stayed the same. Several members asked for a clearer report on energy
costs, and the chair promised to circulate one before the next meeting in March.""",
    """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out""",
    """Glaciers form where more snow falls in winter than melts in summer. Year after year the snow
is pressed into dense ice, which slowly flows downhill under its own weight. As it moves, the ice
carves valleys, carries boulders for many kilometres and leaves long ridges of gravel behind.""",
    """Dear Mr Okafor, thank you for your letter of the twelfth. I am glad to confirm that the
workshop will take place in room four on the second floor. Please bring your laptop and a copy of
the draft report. Lunch will be served at one o'clock. With best regards, Helen Price.""",
    """The old lighthouse keeper kept a logbook for forty years. Every night he wrote the wind
direction, the state of the sea and the ships that passed. Most entries were short, but on
stormy nights the pages filled with careful notes about waves breaking over the rocks.""",
    """In a relational database, a table stores rows that share the same columns. A primary key
identifies each row, and a foreign key links a row to a row in another table. Indexes make
lookups fast but slow down writes, so they should be chosen with the common queries in mind.""",
    """Question: A train leaves at 14:05 and arrives at 17:50. How long is the journey?
Answer: From 14:05 to 17:05 is three hours, and from 17:05 to 17:50 is forty five minutes, so the
journey takes three hours and forty five minutes.""",
    """Maple trees are tapped in early spring, when cold nights and mild days make the sap flow.
Roughly forty litres of sap are boiled down to make a single litre of syrup, which is why real
maple syrup is expensive and why farmers watch the weather so closely in March.""",
    """The museum's new exhibition follows the history of timekeeping: sundials from ancient
gardens, water clocks, pendulum clocks from the seventeenth century, marine chronometers that
made safe navigation possible, and finally the quartz and atomic clocks we rely on today.""",
    """User: What is the difference between weather and climate?
Assistant: Weather describes conditions over hours or days, such as rain tomorrow afternoon.
Climate describes the average pattern over decades, such as how warm and wet a region usually is
in summer.""",
    """Our hiking group set off at eight from the car park by the reservoir. The first hour was an
easy walk along the shore, then the path climbed steeply through pine forest to a rocky ridge.
We ate lunch at the summit cairn, sheltered from the wind, and returned by the southern valley.""",
    """for (int i = 0; i < n; ++i) {
    sum += a[i] * b[i];
}
printf("dot product = %f\\n", sum);""",
    """Bees communicate the location of flowers with a waggle dance. The angle of the dance
relative to vertical shows the direction of the food compared with the sun, and the length of
the waggle run tells the other bees roughly how far they need to fly.""",
    """The quarterly report shows revenue of 12.4 million, up 8 percent on the same quarter last
year. Operating costs grew by 3 percent, mostly because of higher shipping prices. The board
expects growth to slow slightly in the second half as new competitors enter the market.""",
    """Once upon a time, in a village at the edge of a great marsh, there lived a potter who could
not sing. Every evening the villagers gathered to sing by the fire, and every evening the potter
sat quietly, shaping small clay birds that she gave to the children before they went home.""",
    """Photosynthesis takes place mainly in the leaves. Chlorophyll absorbs red and blue light,
and the plant uses that energy to turn carbon dioxide and water into sugar, releasing oxygen as
a by-product. The sugar feeds the plant and, through food chains, almost every animal on land.""",
    """Before you install the update, save your work and close all open programs. The installer
will restart the computer twice. If the screen stays black for more than ten minutes, hold the
power button for five seconds and contact the help desk at extension 4410.""",
    """User: Translate 'good morning' into French, Spanish and German.
Assistant: In French it is 'bonjour', in Spanish 'buenos días', and in German 'guten Morgen'.""",
    """The river delta changes shape every year. Floods bring fresh sediment that builds new
islands, while storms wash older banks away. Fishermen who have worked there for decades say
they redraw their mental map of the channels each spring.""",
    """import json

def load_settings(path):
    with open(path) as f:
        data = json.load(f)
    return {key.lower(): value for key, value in data.items()}""",
    """A good night's sleep helps memory. During deep sleep the brain replays the day's
experiences and strengthens the connections that matter. People who study in the evening and
sleep well often remember more the next day than those who stay up late cramming.""",
    """The chess club meets every Tuesday in the back room of the café. Beginners play on the
tables by the window, where a volunteer explains openings and common mistakes, while the
stronger players play timed games of fifteen minutes each in the quieter corner.""",
    """Numbers: 0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144. Each term after the first two is the sum
of the two before it. The ratio of neighbouring terms approaches 1.618, the golden ratio.""",
    """When the power failed, the hospital's generators started within seconds. Nurses checked
every ventilator and monitor, the lifts were stopped at the nearest floor, and the kitchen kept
the soup warm on gas burners until the mains supply returned two hours later.""",
    """User: Write a haiku about autumn.
Assistant: Red leaves drift and fall / the cold river carries them / past the silent mill.""",
    """Volunteers counted birds along the coast last weekend. They recorded more than two thousand
oystercatchers, six hundred curlews and a single spoonbill, which caused great excitement
because it had not been seen in the area for over ten years.""",
    """The recipe calls for ripe tomatoes, a red onion, two cloves of garlic, olive oil, salt and
a handful of basil. Chop everything finely, mix it in a bowl, and let it rest for twenty minutes
so the flavours combine before you spread it on toasted bread.""",
)


def texts() -> list[str]:
    """The paragraphs, whitespace-normalized per line."""
    return [" ".join(line.strip() for line in p.splitlines()) if not _is_code(p) else p for p in PARAGRAPHS]


def _is_code(p: str) -> bool:
    return any(tok in p for tok in ("def ", "for (", "import "))


def lines() -> list[str]:
    """Every non-empty line (tokenizer training input)."""
    return [ln for p in PARAGRAPHS for ln in p.splitlines() if ln.strip()]
