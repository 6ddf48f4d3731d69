"""The words of ALFWorld's text games, for the tiny test model's word-level tokenizer.

``backbone.tiny.vocabulary=alfworld`` adds these to the tiny tokenizer (``elasticmem.backbone``), so
that commands, observations and objectives tokenize as words rather than ``<unk>``: the 109
object and receptacle types of ALFWorld (``alfworld.gen.constants`` OBJECTS and RECEPTACLES,
lower-cased as the text engine writes them), the words of its commands, feedback and goal
sentences, instance numbers, and the step prompt's own words (``imitation.ALFWORLD_SUFFIX``).
Written out here so the tokenizer does not need the engine installed; it sits in the data layer,
below the backbone that reads it (the agent package, above both, uses it through the tokenizer).
"""

from __future__ import annotations

ALFWORLD_TYPES = tuple("""
alarmclock apple armchair baseballbat basketball bathtub bathtubbasin bed blinds book boots bowl box
bread butterknife cabinet candle cart cd cellphone chair cloth coffeemachine coffeetable countertop
creditcard cup curtains desk desklamp diningtable dishsponge drawer dresser egg floorlamp footstool
fork fridge garbagecan glassbottle handtowel handtowelholder houseplant kettle keychain knife ladle
laptop laundryhamper laundryhamperlid lettuce lightswitch microwave mirror mug newspaper ottoman
painting paintinghanger pan papertowel papertowelroll pen pencil peppershaker pillow plate plunger
poster pot potato remotecontrol safe saltshaker scrubbrush shelf showerdoor showerglass sidetable
sink sinkbasin soapbar soapbottle sofa spatula spoon spraybottle statue stoveburner stoveknob
teddybear television tennisracket tissuebox toaster toilet toiletpaper toiletpaperhanger
toiletpaperroll tomato towel towelholder tvstand vase watch wateringcan window winebottle
""".split())
"""ALFWorld's object and receptacle types, lower-cased."""

ALFWORLD_TEXT = tuple("""
a an the some two and of in on at to into from with using under it its is are you your there
go take put move open close clean heat cool slice use toggle turn examine look inventory help
arrive pick up see nothing happens closed middle room looking quickly around facing next not
carrying anything find then place hot cold cool clean sliced special about s
Your task is You are Nothing Looking On In ACTION OBSERVATION Recent steps Current observation
Admissible commands Reply with exactly one admissible command for next step Action none
""".split())
"""Words of ALFWorld's commands, feedback and goal sentences, and of the step prompt."""

ALFWORLD_WORDS = ALFWORLD_TYPES + ALFWORLD_TEXT + tuple(str(i) for i in range(1, 21))
"""Every word the tiny tokenizer's ``alfworld`` vocabulary adds (instance numbers 1-20 included)."""
