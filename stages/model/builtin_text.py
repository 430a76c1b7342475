"""The plain English text ``builtin:tiny``'s tokenizer is trained on (written for kvstep).

Changing a character here changes the tokenizer, hence the builtin model's cache key.
"""

from __future__ import annotations

__all__ = ["TRAINING_TEXT"]

TRAINING_TEXT = """\
Hello world. Hello there, how are you today? I am well, thank you for asking.
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind.
A language model reads a prompt, one token at a time, and then it writes a reply.
Each token is a small piece of text: a word, a part of a word, a space or a sign.
When the model reads a long prompt, it keeps what it has seen in a key value cache,
so the next token does not have to read the whole prompt again from the start.
The cache is cut into blocks of a fixed size. A block that is full can be shared by
every request whose prompt begins with the same words, and it can be saved to disk
and loaded again later, when the same prompt comes back.

The user asks a question. The assistant answers it as well as it can. The system
message tells the assistant how it should behave: be brief, be kind, be correct.
What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four.
Can you write a short poem about the sea? The sea is wide, the sea is deep, it sings
the sailors all to sleep.
Please tell me a story. Once upon a time there was a small town by a river. In the
town there lived a baker who made the best bread in the whole country. Every morning
she rose before the sun, lit her oven and baked loaves that smelled of warm wheat and
honey. People came from far away to buy her bread, and she was happy.
Thank you. You are welcome. Good morning, good afternoon, good evening, good night.

Numbers are written with digits: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 42 100 1000 2024.
Some words are short: a, an, at, be, by, do, go, he, if, in, is, it, me, my, no, of,
on, or, so, to, up, us, we. Others are longer: information, understanding, beautiful,
computer, language, remember, different, important, government, experience.
People often say things like "I think so", "I do not know", "let me see", "of course",
"that is right", "that is wrong", "maybe later", "why not?" and "see you soon!".

In the spring the trees turn green and the birds come back from the south. In the
summer the days are long and warm, and children play outside until dark. In the autumn
the leaves fall, red and gold, and the air smells of rain. In the winter it is cold,
the nights are long, and snow covers the fields and the roads.
My friend has a cat and two dogs. The cat sleeps all day in the sun by the window;
the dogs run in the garden and bark at the birds. On Sundays we walk to the park, eat
lunch under a tree, read a book, and talk about the week that has passed.
Time flies like an arrow; fruit flies like a banana. Better late than never. Where
there is a will, there is a way. Practice makes perfect. Knowledge is power.

How does a computer work? It follows a program, a list of simple steps, very quickly.
It reads numbers from memory, adds them, compares them, and writes new numbers back.
A program can open a file, send a message over the network, draw a picture on the
screen, or answer a question. Good programs are clear, small, tested and fast.
Write tests first, then write the code, then make it simple. Read the error message.
If something fails, find out why before you change anything. Measure, do not guess.

Dear Sir or Madam, I am writing to ask about the room you have for rent. Could you
tell me the price, and when it would be free? I would like to visit it next week, on
Monday or Tuesday if possible. Thank you in advance for your answer. Best regards.

Questions and answers:
Q: Who wrote this text? A: It was written for a small test model.
Q: Is the model any good? A: No, its weights are random; it only shows the way.
Q: Why is it here? A: So that text prompts, chat and replies work out of the box.
Q: What comes next? A: Whatever the model writes, one token after another.
"""
